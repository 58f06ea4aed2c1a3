"""Chunked log-probs / entropies: equal to the naive log-softmax, differentiable, and never [N x V] in memory."""

import pytest
import torch

from agentenv.samplers.tiny import QWEN25_VOCAB_SIZE, TinyConfig, tiny_model
from agentenv.trainer.logprobs import chunked_log_probs, naive_log_probs, token_log_probs

V = QWEN25_VOCAB_SIZE


@pytest.fixture(scope="module")
def model():
    return tiny_model(TinyConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                 intermediate_size=32, seed=1))


@pytest.mark.parametrize("chunk, temperature, bias", [(64, 1.0, False), (1000, 0.6, True)])
def test_chunked_equals_naive_at_real_vocab(chunk, temperature, bias):
    g = torch.Generator().manual_seed(0)
    n, h = 72, 16  # chunk 64 does not divide 72; chunk 1000 exceeds it
    hidden = torch.randn(n, h, generator=g).requires_grad_()
    weight = (0.5 * torch.randn(V, h, generator=g)).requires_grad_()
    b = torch.randn(V, generator=g).requires_grad_() if bias else None
    targets = torch.randint(0, V, (n,), generator=g)
    upstream = torch.randn(n, generator=g)
    inputs = [hidden, weight] + ([b] if bias else [])

    lp, ent = chunked_log_probs(hidden, weight, targets, bias=b, chunk_size=chunk, temperature=temperature,
                                with_entropy=True)
    grads = torch.autograd.grad((lp * upstream).sum(), inputs)
    ref, ref_ent = naive_log_probs(hidden, weight, targets, bias=b, temperature=temperature, with_entropy=True)
    ref_grads = torch.autograd.grad((ref * upstream).sum(), inputs)

    assert lp.dtype == torch.float32 and lp.shape == (n,) and (lp <= 0).all()
    torch.testing.assert_close(lp, ref, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-5, atol=1e-3)
    assert not ent.requires_grad
    for a, r in zip(grads, ref_grads):
        torch.testing.assert_close(a, r, rtol=1e-4, atol=1e-5 * float(r.abs().max()))


def test_float64_gradcheck():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(5, 3, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(11, 3, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(11, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.tensor([0, 10, 3, 3, 7])
    fn = lambda h, w, b: chunked_log_probs(h, w, targets, bias=b, chunk_size=2, temperature=0.8)[0]
    assert torch.autograd.gradcheck(fn, (hidden, weight, bias))


def test_no_tensor_of_tokens_times_vocab_is_kept_for_backward():
    """Everything autograd saves for the backward is recorded: the chunked path keeps O(N x H + N), the naive one the
    whole [N x V] log-softmax."""
    n, h, chunk = 32, 8, 8
    hidden = torch.randn(n, h, requires_grad=True)
    weight = torch.randn(V, h, requires_grad=True)
    targets = torch.randint(0, V, (n,))

    def largest_saved(fn):
        sizes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.numel()) or t, lambda t: t):
            fn(hidden, weight, targets)[0].sum().backward()
        return max(sizes)

    assert largest_saved(lambda *a: chunked_log_probs(*a, chunk_size=chunk, with_entropy=True)) == V * h  # the weight
    assert largest_saved(naive_log_probs) >= n * V


def test_token_log_probs_match_the_hf_forward(model):
    ids = torch.tensor([[151644, 872, 198, 9707, 151645, 0], [151644, 77091, 198, 40, 1079, 151645]])
    attn = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    mask = torch.tensor([[False, False, False, True, True, False], [False, False, True, True, False, True]])
    lp, ent = token_log_probs(model, ids, attn, mask, chunk_size=3, with_entropy=True)
    logits = model(input_ids=ids, attention_mask=attn).logits.float()
    full = torch.log_softmax(logits[:, :-1], dim=-1)
    ref = torch.zeros_like(lp)
    ref[:, 1:] = full.gather(2, ids[:, 1:, None]).squeeze(2)
    ref_ent = torch.zeros_like(lp)
    ref_ent[:, 1:] = -(full.exp() * full).sum(-1)
    torch.testing.assert_close(lp, torch.where(mask, ref, 0.0), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, torch.where(mask, ref_ent, 0.0), rtol=1e-5, atol=1e-4)
    assert (lp[~mask] == 0).all() and (ent[~mask] == 0).all()

    # gradients w.r.t. every parameter (tied embedding / lm_head included) agree with the naive path
    params = list(model.parameters())
    got = torch.autograd.grad(lp.sum(), params)
    want = torch.autograd.grad(torch.where(mask, ref, 0.0).sum(), params)
    for a, b in zip(got, want):  # float32 sums over 151,665 logits in another order: agree to ~1e-5 of the scale
        torch.testing.assert_close(a, b, rtol=1e-4, atol=2e-5 * float(b.abs().max()))


def test_bf16_hidden_states_give_float32_log_probs_close_to_naive():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(40, 16, generator=g).bfloat16().requires_grad_()
    weight = (0.3 * torch.randn(V, 16, generator=g)).requires_grad_()  # fp32 master weight, as under autocast
    targets = torch.randint(0, V, (40,), generator=g)
    lp, _ = chunked_log_probs(hidden, weight, targets, chunk_size=16)
    ref, _ = naive_log_probs(hidden, weight, targets)
    assert lp.dtype == torch.float32
    torch.testing.assert_close(lp, ref, rtol=1e-4, atol=1e-3)
    lp.sum().backward()
    assert hidden.grad.dtype == torch.bfloat16 and weight.grad.dtype == torch.float32


def test_errors(model):
    ids = torch.tensor([[1, 2, 3]])
    attn = torch.ones(1, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="first token"):
        token_log_probs(model, ids, attn, torch.tensor([[True, True, False]]))
    with pytest.raises(ValueError, match="boolean"):
        token_log_probs(model, ids, attn, torch.tensor([[0, 1, 1]]))
    with pytest.raises(ValueError, match="target ids"):
        chunked_log_probs(torch.randn(2, 4), torch.randn(10, 4), torch.tensor([3, 10]))
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_log_probs(torch.randn(2, 4), torch.randn(10, 4), torch.tensor([3, 1]), chunk_size=0)
