"""Every rule of the FlashREINFORCE objective, pinned with hand-computed values."""

import math

import pytest
import torch

from agentenv.trainer.objectives import (
    FullBatch,
    flashreinforce_loss,
    group_advantages,
    grpo_loss,
    sequence_kl,
    top_entropy_mask,
)

L = math.log


def leaf(rows, dtype=torch.float32):
    return torch.tensor(rows, dtype=dtype, requires_grad=True)


def grad_of(loss, x):
    (g,) = torch.autograd.grad(loss, x)
    return g


# --- the gradient is the paper's g_hat ------------------------------------------------------------------------------


def test_gradient_wrt_log_probs_is_minus_m_A_rho_over_B_T():
    # rewards [1, 0, .5] -> mean .5 -> A = [.5, -.5, 0]; delta=inf so every row is admitted.
    lp = leaf([[0.0, L(.5), L(.5)], [0.0, L(.25), 0.0], [0.0, L(.5), 0.0]])
    mu = torch.tensor([[0.0, L(.25), L(.5)], [0.0, L(.5), 0.0], [0.0, L(.5), 0.0]])
    mask = torch.tensor([[False, True, True], [False, True, False], [False, True, False]])
    loss, st = flashreinforce_loss(lp, mu, torch.tensor([1.0, 0.0, 0.5]), mask, delta=math.inf)
    # row 0: rho = [2, 1], T=2 -> -(.5*2)/(3*2), -(.5*1)/(3*2); row 1: rho=.5, T=1 -> -(-.5*.5)/3; row 2: A=0
    expected = torch.tensor([[0, -1 / 6, -1 / 12], [0, 1 / 12, 0], [0, 0, 0]])
    torch.testing.assert_close(grad_of(loss, lp), expected, rtol=1e-6, atol=1e-7)
    assert loss.item() == pytest.approx(-((1 / 6) * L(.5) + (1 / 12) * L(.5) - (1 / 12) * L(.25)), rel=1e-6)
    torch.testing.assert_close(st["advantages"], torch.tensor([0.5, -0.5, 0.0]))
    torch.testing.assert_close(st["ratio_max"], torch.tensor(2.0))
    torch.testing.assert_close(st["ratio_min"], torch.tensor(0.5))
    torch.testing.assert_close(st["ratio_mean"], torch.tensor((2 + 1 + .5 + 1) / 4))


def test_gradient_equals_g_hat_on_a_real_model(tiny):
    """-grad(loss) wrt the model's parameters == (1/B) sum_i m_i A_i / T_i sum_t rho_it grad log pi_it, with
    each grad log pi_it taken separately by autograd."""
    from agentenv.trainer.logprobs import token_log_probs

    model = tiny
    ids = torch.tensor([[5, 17, 99, 1000, 7], [3, 8, 11, 2, 0]])
    am = torch.ones_like(ids, dtype=torch.bool)
    mask = torch.tensor([[False, True, True, True, False], [False, False, True, True, False]])
    params = [p for p in model.parameters()]
    logp, _ = token_log_probs(model, ids, am, mask)
    # behaviour: row 0 a little more likely than pi (admitted), row 1 sampled at p = .9 where pi ~ 1/1024 (rejected)
    off = torch.tensor([[0, .01, .02, .005, 0], [0, 0, 0, 0, 0]], dtype=logp.dtype)
    mu = torch.where(mask, logp.detach() - off, 0.0)
    mu[1, 2:4] = math.log(0.9)
    rewards = torch.tensor([1.0, 0.0])
    loss, st = flashreinforce_loss(logp, mu, rewards, mask, delta=3e-3)
    assert st["admitted"].tolist() == [True, False]
    got = torch.autograd.grad(loss, params, allow_unused=True)

    A, B = [0.5, -0.5], 2
    g_hat = [torch.zeros_like(p) for p in params]
    for i, t in mask.nonzero().tolist():
        if not st["admitted"][i]:
            continue
        lp_it, _ = token_log_probs(model, ids, am, mask)
        rho = math.exp(lp_it[i, t].item() - mu[i, t].item())
        grads = torch.autograd.grad(lp_it[i, t], params, allow_unused=True)
        for acc, g in zip(g_hat, grads):
            if g is not None:
                acc += A[i] * rho / (B * int(mask[i].sum())) * g
    for g, gh in zip(got, g_hat):
        # Qwen2's RMSNorm computes in float32 even in a float64 model, so agreement is to float32 rounding
        torch.testing.assert_close(-(g if g is not None else torch.zeros_like(gh)), gh, rtol=1e-4,
                                   atol=1e-6 * float(gh.abs().max()))


def test_rejected_row_keeps_the_original_batch_size():
    # row 1 drifts (p=.9 vs q=.1) and is rejected; row 0 must still be divided by B=2, not by 1 admitted row.
    lp = leaf([[0.0, L(.5)], [0.0, L(.1)]])
    mu = torch.tensor([[0.0, L(.5)], [0.0, L(.9)]])
    mask = torch.tensor([[False, True], [False, True]])
    loss, st = flashreinforce_loss(lp, mu, torch.tensor([1.0, 0.0]), mask, delta=3e-3)
    assert st["admitted"].tolist() == [True, False]
    assert st["acceptance_rate"].item() == 0.5
    assert st["retained_tokens"].tolist() == [1, 0] and st["policy_tokens"].tolist() == [1, 1]
    torch.testing.assert_close(grad_of(loss, lp), torch.tensor([[0.0, -0.5 / 2], [0.0, 0.0]]))


def test_failure_filter_keeps_the_original_T_i():
    mask = torch.tensor([[False, True, True, True, True]])
    ent = torch.tensor([[0.0, 3.0, 1.0, 2.0, 0.5]])
    # a failed row (A = -.5) and a successful one (A = +.5), T_i = 4 each
    lp2 = leaf([[0.0] + [L(.5)] * 4, [0.0] + [L(.5)] * 4])
    mask2 = mask.repeat(2, 1)
    loss, st = flashreinforce_loss(lp2, lp2.detach(), torch.tensor([0.0, 1.0]), mask2, negative_token_fraction=0.5,
                                   entropies=ent.repeat(2, 1), failures=torch.tensor([True, False]))
    assert st["retained_tokens"].tolist() == [2, 4]
    g = grad_of(loss, lp2)
    # failed row keeps the 2 highest-entropy tokens (positions 1 and 3), each weighted -A/(B*T_i) with T_i = 4
    torch.testing.assert_close(g[0], torch.tensor([0.0, 0.5 / 8, 0.0, 0.5 / 8, 0.0]))
    torch.testing.assert_close(g[1], torch.full((5,), -0.5 / 8) * mask[0])


def test_sample_mean_gives_long_and_short_rows_the_same_total_mass():
    T_long, T_short = 10, 2
    # two failures (T = 10 and 2) and one success (T = 2): A = [-1/3, -1/3, 2/3]
    lp3 = torch.full((3, 11), L(.5)).requires_grad_()
    mask3 = torch.zeros(3, 11, dtype=torch.bool)
    mask3[0, 1:1 + T_long] = True
    mask3[1:, 1:1 + T_short] = True
    loss, _ = flashreinforce_loss(lp3, lp3.detach(), torch.tensor([0.0, 0.0, 1.0]), mask3, delta=math.inf)
    g = grad_of(loss, lp3)
    assert g[0].sum().item() == pytest.approx(g[1].sum().item(), rel=1e-6)  # both = (1/3) / 3
    assert g[0].sum().item() == pytest.approx((1 / 3) / 3, rel=1e-6)
    # the token-mean ablation instead weights by length: mass_i = |A_i| T_i / sum_j T_j
    loss_tm, _ = flashreinforce_loss(lp3, lp3.detach(), torch.tensor([0.0, 0.0, 1.0]), mask3, delta=math.inf,
                                     token_mean=True)
    g = grad_of(loss_tm, lp3)
    assert g[0].sum().item() == pytest.approx((1 / 3) * 10 / 14, rel=1e-6)
    assert g[1].sum().item() == pytest.approx((1 / 3) * 2 / 14, rel=1e-6)


# --- the sequence gate ----------------------------------------------------------------------------------------------


def test_sequence_kl_hand_value_and_clamps():
    # p=.5, q=.25: .5 ln(.5/.25) + .5 ln(.5/.75) = .5 ln(4/3); second token p=q -> 0; mean over T=2
    lp = torch.tensor([[0.0, L(.25), L(.7)]], dtype=torch.float64)
    mu = torch.tensor([[0.0, L(.5), L(.7)]], dtype=torch.float64)
    mask = torch.tensor([[False, True, True]])
    assert sequence_kl(lp, mu, mask).item() == pytest.approx(0.5 * L(4 / 3) / 2, rel=1e-12)
    # p = exp(0) = 1 and q = exp(-50) are clamped to 1-1e-6 and 1e-6
    e = 1e-6
    d = (1 - e) * L((1 - e) / e) + e * L(e / (1 - e))
    assert sequence_kl(torch.tensor([[0.0, -50.0]]), torch.tensor([[0.0, 0.0]]), mask[:, :2]).item() == \
        pytest.approx(d, rel=1e-9)
    assert sequence_kl(mu, mu, mask).item() == 0.0


def test_gate_boundary_D_equal_delta_admits_and_direction():
    lp = leaf([[0.0, L(.25)], [0.0, L(.45)]])
    mu = torch.tensor([[0.0, L(.5)], [0.0, L(.5)]])
    mask = torch.tensor([[False, True], [False, True]])
    r = torch.tensor([1.0, 0.0])
    _, st = flashreinforce_loss(lp, mu, r, mask, delta=math.inf)
    D = st["seq_kl"]
    assert D[0] > D[1] > 0  # more drift, larger statistic
    at = D[0].item()
    _, st = flashreinforce_loss(lp, mu, r, mask, delta=at)
    assert st["admitted"].tolist() == [True, True]  # D = delta admits
    _, st = flashreinforce_loss(lp, mu, r, mask, delta=math.nextafter(at, 0.0))
    assert st["admitted"].tolist() == [False, True]  # just below: the drifting row goes, the close one stays
    _, st = flashreinforce_loss(lp, mu, r, mask, delta=0.0)
    assert st["admitted"].tolist() == [False, False]


def test_all_rejected_and_homogeneous_rewards_give_exactly_zero_gradient():
    lp = leaf([[0.0, L(.1), L(.2)], [0.0, L(.3), 0.0]])
    mu = torch.tensor([[0.0, L(.9), L(.8)], [0.0, L(.9), 0.0]])
    mask = torch.tensor([[False, True, True], [False, True, False]])
    loss, st = flashreinforce_loss(lp, mu, torch.tensor([1.0, 0.0]), mask)
    assert st["acceptance_rate"].item() == 0.0 and st["retained_tokens"].sum().item() == 0
    assert torch.isnan(st["ratio_mean"])  # no retained token: no ratio statistic
    assert torch.count_nonzero(grad_of(loss, lp)) == 0
    for r in (0.3, 1 / 3, -7.1):  # values whose naive float mean is not exactly themselves
        rewards = torch.full((7,), r, dtype=torch.float64)
        lp7 = torch.full((7, 3), L(.5), requires_grad=True)
        m7 = torch.ones(7, 3, dtype=torch.bool)
        loss, st = flashreinforce_loss(lp7, lp7.detach(), rewards, m7, delta=math.inf)
        assert torch.count_nonzero(st["advantages"]) == 0
        assert torch.count_nonzero(grad_of(loss, lp7)) == 0


# --- the failure filter ---------------------------------------------------------------------------------------------


def test_filter_keeps_exactly_ceil_q_T_with_ties_by_position():
    mask = torch.tensor([[False, True, True, True, True, True]])
    ent = torch.tensor([[9.0, 0.1, 0.9, 0.5, 0.9, 0.3]])  # slot 0 is not a policy token: never selected
    keep = lambda q: top_entropy_mask(ent, mask, q)[0].nonzero().flatten().tolist()
    assert keep(0.5) == [2, 3, 4]  # ceil(2.5) = 3
    assert keep(0.25) == [2, 4]  # ceil(1.25) = 2: both 0.9s
    assert keep(0.2) == [2]  # ceil(1.0) = 1: the tie goes to the earlier position
    assert keep(0.0) == [] and keep(1.0) == [1, 2, 3, 4, 5]
    mask10 = torch.ones(1, 10, dtype=torch.bool)
    assert int(top_entropy_mask(torch.rand(1, 10), mask10, 0.7).sum()) == 7  # not ceil(7.000000000000001) = 8
    assert int(top_entropy_mask(torch.rand(1, 10), mask10, 0.1).sum()) == 1
    assert int(top_entropy_mask(torch.rand(1, 100), torch.ones(1, 100, dtype=torch.bool), 0.07).sum()) == 7


def test_filter_ignores_advantage_sign_and_spares_successes():
    # three rows: failed with A<0, failed with A>0 (a partial-credit failure above the mean), success
    lp = torch.full((3, 5), L(.5), requires_grad=True)
    mask = torch.tensor([[False, True, True, True, True]] * 3)
    ent = torch.tensor([[0.0, 1.0, 4.0, 3.0, 2.0]] * 3)
    rewards = torch.tensor([0.0, 0.8, 0.7])
    failures = torch.tensor([True, True, False])
    loss, st = flashreinforce_loss(lp, lp.detach(), rewards, mask, negative_token_fraction=0.5, entropies=ent,
                                   failures=failures, delta=math.inf)
    assert st["advantages"][1] > 0
    assert st["retained_tokens"].tolist() == [2, 2, 4]
    g = grad_of(loss, lp)
    assert (g[0] != 0).tolist() == [False, False, True, True, False]  # the two highest entropies: positions 2, 3
    assert (g[1] != 0).tolist() == [False, False, True, True, False]
    assert (g[2] != 0).tolist() == [False, True, True, True, True]


# --- what must never leak, and dtypes -------------------------------------------------------------------------------


def test_masked_nan_inf_and_garbage_do_not_leak():
    mask = torch.tensor([[False, True, True, False], [False, True, False, False]])
    clean_lp = torch.tensor([[0.0, L(.5), L(.4), 0.0], [0.0, L(.3), 0.0, 0.0]])
    clean_mu = torch.tensor([[0.0, L(.5), L(.5), 0.0], [0.0, L(.35), 0.0, 0.0]])
    junk = torch.tensor([[float("nan"), 0, 0, float("inf")], [-float("inf"), 0, 5.0, float("nan")]])
    lp = torch.where(mask, clean_lp, junk).requires_grad_()
    mu = torch.where(mask, clean_mu, junk.flip(0))
    ent = torch.where(mask, torch.ones(2, 4), junk)
    kw = dict(negative_token_fraction=0.5, failures=torch.tensor([True, False]), delta=math.inf)
    loss, st = flashreinforce_loss(lp, mu, torch.tensor([0.0, 1.0]), mask, entropies=ent, **kw)
    ref_lp = clean_lp.clone().requires_grad_()
    ref, _ = flashreinforce_loss(ref_lp, clean_mu, torch.tensor([0.0, 1.0]), mask, entropies=torch.ones(2, 4), **kw)
    g = grad_of(loss, lp)
    assert torch.isfinite(loss) and torch.isfinite(g).all()
    assert loss.item() == ref.item()
    torch.testing.assert_close(g, grad_of(ref, ref_lp), rtol=0, atol=0)
    assert (g[~mask] == 0).all()
    for k in ("seq_kl", "ratio_mean", "ratio_max", "entropy_mean"):
        assert torch.isfinite(st[k]).all(), k


def test_log_ratio_is_clamped_to_30_on_kept_tokens_and_rejected_rows_never_exponentiate():
    # Changed on purpose (issue 12): the reference clamps the float32 log-ratio to [-30, 30]; an overflow used to raise.
    lp = leaf([[0.0, -1e-3], [0.0, -1e-3]])
    mu = torch.tensor([[0.0, -200.0], [0.0, -1e-3]])  # log pi - log mu = 199.999: exp overflows float32 unclamped
    mask = torch.tensor([[False, True], [False, True]])
    loss, st = flashreinforce_loss(lp, mu, torch.tensor([0.0, 1.0]), mask, delta=3e-3)  # row 0 rejected: fine
    assert st["admitted"].tolist() == [False, True] and torch.isfinite(loss)
    loss, st = flashreinforce_loss(lp, mu, torch.tensor([0.0, 1.0]), mask, delta=math.inf)
    assert st["ratio_max"].item() == pytest.approx(math.exp(30.0), rel=1e-6) and st["ratio_min"].item() == 1.0
    # d loss / d log pi_01 = -(A_0 rho / (B T_0)) = -(-0.5 * e^30 / 2)
    torch.testing.assert_close(grad_of(loss, lp), torch.tensor([[0.0, 0.25 * math.exp(30.0)], [0.0, -0.25]]))
    # the lower side: log pi - log mu = -100 -> rho = e^-30, float64 too
    lp64 = leaf([[0.0, -100.0]], torch.float64)
    _, st = flashreinforce_loss(lp64, torch.tensor([[0.0, -1e-9]], dtype=torch.float64), torch.tensor([1.0]),
                                mask[:1], delta=math.inf)
    assert st["ratio_max"].item() == pytest.approx(math.exp(-30.0), rel=1e-12)
    # non-finite inputs are still an error, never clamped
    for bad in (float("inf"), float("nan")):
        with pytest.raises(ValueError, match="non-finite"):
            flashreinforce_loss(lp, torch.tensor([[0.0, -bad]]).expand(2, 2), torch.tensor([0.0, 1.0]), mask)


def test_half_precision_promotes_to_float32_and_float64_stays():
    mask = torch.tensor([[False, True, True]])
    for dtype, want in ((torch.bfloat16, torch.float32), (torch.float16, torch.float32), (torch.float32, torch.float32),
                        (torch.float64, torch.float64)):
        lp = torch.tensor([[0.0, -0.5, -1.0]], dtype=dtype, requires_grad=True)
        mu = torch.tensor([[0.0, -0.6, -0.9]], dtype=dtype)
        loss, st = flashreinforce_loss(lp, mu, torch.tensor([1.0]), mask, delta=math.inf)
        assert loss.dtype == want and st["ratio_mean"].dtype == want and st["advantages"].dtype == want
        assert grad_of(loss, lp).dtype == dtype
    # float16 inputs whose ratio exp(12) = 162755 exceeds float16's max (65504): finite after promotion
    lp = torch.tensor([[0.0, -0.001]], dtype=torch.float16)
    mu = torch.tensor([[0.0, -12.0]], dtype=torch.float16)
    _, st = flashreinforce_loss(lp, mu, torch.tensor([1.0]), mask[:, :2], delta=math.inf)
    assert st["ratio_max"].item() == pytest.approx(math.exp(12 - 0.001), rel=1e-3)


# --- ablations ------------------------------------------------------------------------------------------------------


def test_no_is_is_the_papers_ablation_ratio_one_and_no_gate():
    # Changed on purpose (issue 12): no_is used to keep the mu-based gate; in the paper it compares pi with itself.
    lp = leaf([[0.0, L(.5)], [0.0, L(.1)]])
    mu = torch.tensor([[0.0, L(.25)], [0.0, L(.9)]])
    mask = torch.tensor([[False, True], [False, True]])
    loss, st = flashreinforce_loss(lp, mu, torch.tensor([1.0, 0.0]), mask, no_is=True, delta=0.0)
    assert st["admitted"].tolist() == [True, True]  # both rows drift (D = .131 and 1.76) yet nothing is rejected
    kl0 = .25 * L(.25 / .5) + .75 * L(.75 / .5)
    kl1 = .9 * L(.9 / .1) + .1 * L(.1 / .9)
    # still reported: the measured KL(mu || pi)
    torch.testing.assert_close(st["seq_kl"], torch.tensor([kl0, kl1], dtype=torch.float64), rtol=1e-5, atol=1e-7)
    # A = (+.5, -.5), rho = 1 (not 2 and .11), 1/(B T_i) = 1/2
    torch.testing.assert_close(grad_of(loss, lp), torch.tensor([[0.0, -0.5 / 2], [0.0, 0.5 / 2]]))
    assert st["ratio_max"].item() == st["ratio_min"].item() == 1.0 and st["retained_tokens"].tolist() == [1, 1]


def test_constant_length_divides_every_row_by_b_times_the_constant():
    lp = leaf([[0.0, L(.5), L(.5), L(.5)], [0.0, L(.2), 0.0, 0.0]])
    mask = torch.tensor([[False, True, True, True], [False, True, False, False]])
    loss, _ = flashreinforce_loss(lp, lp.detach(), torch.tensor([1.0, 0.0]), mask, delta=math.inf, constant_length=4)
    # A = (+.5, -.5), rho = 1, weight = A / (B * 4) = +-1/16 on every policy token whatever the row's length (3, 1)
    w = 0.5 / (2 * 4)
    torch.testing.assert_close(grad_of(loss, lp), torch.tensor([[0.0, -w, -w, -w], [0.0, w, 0.0, 0.0]]))
    assert loss.item() == pytest.approx(-(w * 3 * L(.5) - w * L(.2)))
    with pytest.raises(ValueError, match="choose one"):
        flashreinforce_loss(lp, lp.detach(), torch.tensor([1.0, 0.0]), mask, token_mean=True, constant_length=4)
    with pytest.raises(ValueError, match="constant_length must be a positive int"):
        flashreinforce_loss(lp, lp.detach(), torch.tensor([1.0, 0.0]), mask, constant_length=0)


def test_micro_batches_with_full_batch_totals_sum_to_the_full_loss():
    torch.manual_seed(0)
    lp = (-torch.rand(4, 6)).requires_grad_()
    mu = lp.detach() - 0.01 * torch.rand(4, 6)
    mask = torch.rand(4, 6) < 0.7
    mask[:, 0] = True
    rewards = torch.tensor([1.0, 0.0, 0.25, 1.0])
    for token_mean in (False, True):
        full, _ = flashreinforce_loss(lp, mu, rewards, mask, token_mean=token_mean)
        fb = FullBatch.of(rewards, mask)
        parts = [flashreinforce_loss(lp[r], mu[r], rewards[r], mask[r], token_mean=token_mean, full_batch=fb)[0]
                 for r in ([0, 2], [3], [1])]
        assert sum(p.item() for p in parts) == pytest.approx(full.item(), abs=1e-7)  # terms are ~1e-1
        torch.testing.assert_close(grad_of(sum(parts), lp), grad_of(full, lp), rtol=1e-6, atol=1e-9)


def test_grpo_group_advantages_and_clipped_token_mean():
    adv = group_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0, 0.3]), ["a", "a", "b", "b", "c"])
    assert adv.tolist() == [0.5, -0.5, 0.0, 0.0, 0.0]  # no std normalisation; singleton group -> 0
    # token 1: rho = 1.5 > 1.2 with A > 0 -> clipped, no gradient; token 2: rho = .5 with A > 0 -> -A rho / N
    lp = leaf([[0.0, L(.75), L(.25)], [0.0, L(.75), 0.0]])
    mu = torch.tensor([[0.0, L(.5), L(.5)], [0.0, L(.5), 0.0]])
    mask = torch.tensor([[False, True, True], [False, True, False]])
    loss, st = grpo_loss(lp, mu, torch.tensor([1.0, -1.0]), mask, clip_eps=0.2)
    # row 1: rho = 1.5 with A < 0 -> min picks the unclipped -1.5 -> gradient -(-1 * 1.5)/3
    torch.testing.assert_close(grad_of(loss, lp), torch.tensor([[0.0, 0.0, -0.5 / 3], [0.0, 1.5 / 3, 0.0]]))
    assert st["clip_fraction"].item() == pytest.approx(1 / 3)  # only token 1's objective was clipped


# --- every ValueError -----------------------------------------------------------------------------------------------


def _ok():
    return dict(log_probs=torch.tensor([[0.0, -0.5]]), behavior_log_probs=torch.tensor([[0.0, -0.4]]),
                rewards=torch.tensor([1.0]), action_mask=torch.tensor([[False, True]]))


@pytest.mark.parametrize("change, match", [
    (dict(behavior_log_probs=torch.zeros(1, 3)), "behavior_log_probs has shape"),
    (dict(action_mask=torch.ones(2, 2, dtype=torch.bool)), "action_mask has shape"),
    (dict(rewards=torch.tensor([1.0, 2.0])), "rewards must have shape"),
    (dict(log_probs=torch.zeros(2)), r"log_probs must be \[B, T\]"),
    (dict(action_mask=torch.tensor([[0, 1]])), "boolean"),
    (dict(action_mask=torch.tensor([[False, False]])), "no policy token"),
    (dict(rewards=torch.tensor([float("nan")])), "rewards must be finite"),
    (dict(rewards=torch.tensor([float("inf")])), "rewards must be finite"),
    (dict(log_probs=torch.tensor([[0.0, 0.1]])), "log_probs has positive"),
    (dict(behavior_log_probs=torch.tensor([[0.0, 1e-3]])), "behavior_log_probs has positive"),
    (dict(log_probs=torch.tensor([[0.0, -float("inf")]])), "log_probs has non-finite"),
    (dict(behavior_log_probs=torch.tensor([[0.0, float("nan")]])), "behavior_log_probs has non-finite"),
    (dict(delta=-1e-3), "delta must be >= 0"),
    (dict(delta=float("nan")), "delta must be >= 0"),
    (dict(negative_token_fraction=-0.1), r"negative_token_fraction must be in \[0, 1\]"),
    (dict(negative_token_fraction=1.5), r"negative_token_fraction must be in \[0, 1\]"),
    (dict(negative_token_fraction=float("nan")), r"negative_token_fraction must be in \[0, 1\]"),
    (dict(negative_token_fraction=0.5, failures=torch.tensor([True])), "pass entropies and failures"),
    (dict(negative_token_fraction=0.5, entropies=torch.ones(1, 2)), "pass entropies and failures"),
    (dict(entropies=torch.ones(1, 3)), "entropies has shape"),
    (dict(failures=torch.tensor([1])), "failures must be a boolean"),
])
def test_value_errors(change, match):
    kw = _ok()
    kw.update(change)
    args = [kw.pop(k) for k in ("log_probs", "behavior_log_probs", "rewards", "action_mask")]
    with pytest.raises(ValueError, match=match):
        flashreinforce_loss(*args, **kw)


def test_valid_base_case_runs():
    kw = _ok()
    loss, st = flashreinforce_loss(*[kw[k] for k in ("log_probs", "behavior_log_probs", "rewards", "action_mask")])
    assert st["advantages"].item() == 0.0 and loss.item() == 0.0


@pytest.fixture(scope="module")
def tiny():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(3)
    cfg = Qwen2Config(vocab_size=1024, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, intermediate_size=32, max_position_embeddings=64, tie_word_embeddings=True)
    return Qwen2ForCausalLM(cfg).double().eval()
