"""Property tests (hypothesis) for invariances of the FlashREINFORCE loss."""

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from agentenv.trainer.objectives import FullBatch, flashreinforce_loss

SETTINGS = settings(max_examples=40, deadline=None)


@st.composite
def batches(draw):
    b = draw(st.integers(1, 5))
    t = draw(st.integers(2, 7))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(b, t, generator=g) < 0.6
    mask[torch.arange(b), torch.randint(0, t, (b,), generator=g)] = True  # every row has a policy token
    lp = -3 * torch.rand(b, t, generator=g, dtype=torch.float64)
    drift = draw(st.sampled_from([0.0, 0.01, 0.3]))
    mu = (lp - drift * torch.rand(b, t, generator=g, dtype=torch.float64)).clamp(max=0.0)
    rewards = torch.tensor(draw(st.lists(st.sampled_from([0.0, 0.5, 1.0, -1.0]), min_size=b, max_size=b)),
                           dtype=torch.float64)
    ent = 5 * torch.rand(b, t, generator=g, dtype=torch.float64)
    failures = rewards <= 0
    kw = dict(
        delta=draw(st.sampled_from([0.0, 1e-3, 3e-3, 0.05, math.inf])),
        negative_token_fraction=draw(st.sampled_from([1.0, 0.9, 0.5, 0.0])),
        token_mean=draw(st.booleans()),
        no_is=draw(st.booleans()),
    )
    return lp, mu, rewards, mask, ent, failures, kw


def run(lp, mu, rewards, mask, ent, failures, kw, full_batch=None):
    lp = lp.clone().requires_grad_()
    loss, stats = flashreinforce_loss(lp, mu, rewards, mask, entropies=ent, failures=failures, full_batch=full_batch,
                                      **kw)
    (grad,) = torch.autograd.grad(loss, lp)
    return loss.detach(), grad, stats


@SETTINGS
@given(batches(), st.randoms(use_true_random=False))
def test_permuting_rows_permutes_everything_and_keeps_the_loss(batch, rnd):
    lp, mu, rewards, mask, ent, failures, kw = batch
    perm = list(range(lp.shape[0]))
    rnd.shuffle(perm)
    p = torch.tensor(perm)
    loss, grad, stats = run(lp, mu, rewards, mask, ent, failures, kw)
    loss_p, grad_p, stats_p = run(lp[p], mu[p], rewards[p], mask[p], ent[p], failures[p], kw)
    assert math.isclose(loss.item(), loss_p.item(), rel_tol=1e-9, abs_tol=1e-12)
    torch.testing.assert_close(grad_p, grad[p], rtol=1e-9, atol=1e-12)
    for k in ("advantages", "seq_kl", "admitted", "retained_tokens", "policy_tokens"):
        torch.testing.assert_close(stats_p[k], stats[k][p], rtol=1e-9, atol=1e-12)


@SETTINGS
@given(batches(), st.integers(1, 4), st.sampled_from([float("nan"), float("inf"), -float("inf"), 3.0]))
def test_padding_with_masked_garbage_columns_changes_nothing(batch, extra, junk):
    lp, mu, rewards, mask, ent, failures, kw = batch
    b = lp.shape[0]
    pad = lambda x, v: torch.cat([x, torch.full((b, extra), v, dtype=x.dtype)], dim=1)
    loss, grad, stats = run(lp, mu, rewards, mask, ent, failures, kw)
    loss_p, grad_p, stats_p = run(pad(lp, junk), pad(mu, -junk), rewards, pad(mask, False), pad(ent, junk), failures, kw)
    assert math.isclose(loss.item(), loss_p.item(), rel_tol=1e-12, abs_tol=1e-15)
    torch.testing.assert_close(grad_p[:, : lp.shape[1]], grad, rtol=0, atol=0)
    assert (grad_p[:, lp.shape[1]:] == 0).all()
    for k in ("seq_kl", "admitted", "retained_tokens"):
        torch.testing.assert_close(stats_p[k], stats[k], rtol=0, atol=0)


@SETTINGS
@given(batches(), st.randoms(use_true_random=False))
def test_any_row_split_with_full_batch_totals_sums_to_the_full_loss(batch, rnd):
    lp, mu, rewards, mask, ent, failures, kw = batch
    loss, grad, _ = run(lp, mu, rewards, mask, ent, failures, kw)
    rows = list(range(lp.shape[0]))
    rnd.shuffle(rows)
    cut = rnd.randint(1, len(rows))
    fb = FullBatch.of(rewards, mask)
    total, acc = 0.0, torch.zeros_like(grad)
    for part in (rows[:cut], rows[cut:]):
        if not part:
            continue
        r = torch.tensor(part)
        l, g, _ = run(lp[r], mu[r], rewards[r], mask[r], ent[r], failures[r], kw, full_batch=fb)
        total += l.item()
        acc[r] += g
    assert math.isclose(total, loss.item(), rel_tol=1e-9, abs_tol=1e-12)
    torch.testing.assert_close(acc, grad, rtol=1e-9, atol=1e-12)


@SETTINGS
@given(batches())
def test_gradient_matches_the_closed_form(batch):
    """d loss / d log pi_it = -m_i A_i rho_it / (B T_i) on kept tokens (or / sum T under token_mean), 0 elsewhere;
    retained tokens per failed row never exceed ceil(q T_i), successes keep all admitted tokens."""
    lp, mu, rewards, mask, ent, failures, kw = batch
    _, grad, stats = run(lp, mu, rewards, mask, ent, failures, kw)
    T = mask.sum(1)
    A = rewards - rewards.mean()
    keep = grad != 0
    rho = torch.ones_like(lp) if kw["no_is"] else torch.exp(lp - mu)
    denom = T.sum().double() if kw["token_mean"] else lp.shape[0] * T[:, None].double()
    expected = torch.where(keep, -A[:, None] * rho / denom, 0.0)
    torch.testing.assert_close(grad, expected, rtol=1e-9, atol=1e-12)
    assert not (keep & ~mask).any()
    assert not keep[~stats["admitted"]].any()
    q = kw["negative_token_fraction"]
    for i in range(lp.shape[0]):
        if stats["admitted"][i]:
            want = math.ceil(round(q * int(T[i]), 9)) if failures[i] else int(T[i])
            assert int(stats["retained_tokens"][i]) == want
        else:
            assert int(stats["retained_tokens"][i]) == 0
