"""GRPO objective: hand-computed advantages and clipped loss, packed row == sequences one by one."""

from __future__ import annotations

import math

import pytest
import torch

from learner.core.grpo import (
    META_ADVANTAGE,
    META_OLD_LOGPROBS,
    GrpoConfig,
    GrpoInputError,
    GrpoTokens,
    completion_logprobs,
    group_advantages,
    grpo_loss,
    grpo_row_sums,
    grpo_segment,
    grpo_sums,
    grpo_tokens,
)
from learner.core.packing import Packer, pack
from learner.core.targets import IGNORE_INDEX, Segment

# ---- advantages --------------------------------------------------------------------------------


def test_group_advantages_hand_computed():
    groups = [[1.0, 0.0, 0.5], [2.0, 2.0, 2.0], [3.0], [0.0, 1.0], [0.1, 0.1, 0.1]]
    eps = 1e-4
    # Group 0: mean 0.5, centred (0.5, -0.5, 0), unbiased var (0.25 + 0.25 + 0) / 2 = 0.25, std 0.5.
    g0 = [0.5 / (0.5 + eps), -0.5 / (0.5 + eps), 0.0]
    # Group 3: mean 0.5, centred (-0.5, 0.5), unbiased var (0.25 + 0.25) / 1 = 0.5, std sqrt(0.5).
    s3 = math.sqrt(0.5)
    g3 = [-0.5 / (s3 + eps), 0.5 / (s3 + eps)]
    # Groups 1 and 4 have no variance (4: 0.1 is inexact in binary), group 2 a single sample: zeros.
    want = g0 + [0.0, 0.0, 0.0] + [0.0] + g3 + [0.0, 0.0, 0.0]
    got = group_advantages(groups, eps=eps)
    assert got.dtype == torch.float32 and got.shape == (12,)
    assert got.tolist() == pytest.approx(want, abs=1e-6)
    assert torch.isfinite(got).all()
    zero_idx = [3, 4, 5, 6, 9, 10, 11]
    assert all(got[i].item() == 0.0 for i in zero_idx)  # exactly zero, not a residue / eps
    # Flat rewards with sizes give the same; equal-size groups by an int.
    flat = [r for g in groups for r in g]
    assert torch.equal(group_advantages(flat, [3, 3, 1, 2, 3], eps=eps), got)
    assert group_advantages([1.0, 0.0, 4.0, 4.0], 2).tolist() == pytest.approx(
        [0.5 / (math.sqrt(0.5) + 1e-4), -0.5 / (math.sqrt(0.5) + 1e-4), 0.0, 0.0], abs=1e-6
    )


def test_group_advantages_unscaled_is_centred_rewards():
    got = group_advantages([[1.0, 0.0, 0.5], [7.0], [2.0, 4.0]], scale=False)
    assert got.tolist() == pytest.approx([0.5, -0.5, 0.0, 0.0, -1.0, 1.0], abs=1e-7)


def test_group_advantages_refuses_bad_input():
    with pytest.raises(GrpoInputError, match="finite"):
        group_advantages([[1.0, float("nan")]])
    with pytest.raises(GrpoInputError, match="sum to"):
        group_advantages([1.0, 2.0, 3.0], [2, 2])
    with pytest.raises(GrpoInputError, match="groups of 2"):
        group_advantages([1.0, 2.0, 3.0], 2)
    with pytest.raises(GrpoInputError, match="group_sizes"):
        group_advantages(torch.tensor([1.0, 2.0]))


# ---- clipped loss by hand ----------------------------------------------------------------------


def _row(seqs: list[tuple[list[float], float]], prompt_len: int = 2):
    """A packed row of GRPO segments with the given (old log-probs, advantage) and its tokens."""
    segs = []
    for i, (old, adv) in enumerate(seqs):
        prompt = [100 + i] * prompt_len
        segs.append(grpo_segment(prompt, [10 + j for j in range(len(old))], old, adv))
    row = pack(segs)
    return row, grpo_tokens(row)


# Sequence 0 (A = +1): ratios 1.5, 0.9. Sequence 1 (A = -2): ratios 0.5, 1.1, 1.0.
OLD = [[-1.0, -2.0], [-0.5, -1.5, -3.0]]
RATIOS = [[1.5, 0.9], [0.5, 1.1, 1.0]]
ADV = [1.0, -2.0]


def _hand_case(requires_grad: bool = True):
    row, toks = _row([(OLD[0], ADV[0]), (OLD[1], ADV[1])])
    pairs = [(o, r) for os, rs in zip(OLD, RATIOS, strict=True) for o, r in zip(os, rs, strict=True)]
    logp = torch.tensor([o + math.log(r) for o, r in pairs], requires_grad=requires_grad)
    return row, toks, logp


def test_clipped_loss_hand_computed():
    row, toks, logp = _hand_case()
    assert toks.advantages.tolist() == [1.0, 1.0, -2.0, -2.0, -2.0]
    assert toks.n_tokens == 5 and toks.n_seqs == 2
    cfg = GrpoConfig(clip_eps=0.2)
    # Per token: -min(r * A, clip(r, 0.8, 1.2) * A)
    #   r=1.5, A=+1: -min(1.5, 1.2)   = -1.2  (clipped)
    #   r=0.9, A=+1: -min(0.9, 0.9)   = -0.9
    #   r=0.5, A=-2: -min(-1.0, -1.6) = 1.6   (clipped)
    #   r=1.1, A=-2: -min(-2.2, -2.2) = 2.2
    #   r=1.0, A=-2: -min(-2.0, -2.0) = 2.0
    per_token = [-1.2, -0.9, 1.6, 2.2, 2.0]
    token_mean = (-1.2 - 0.9 + 1.6 + 2.2 + 2.0) / 5  # 0.74
    out = grpo_sums(logp, toks, cfg).finish(cfg)
    assert out.loss.item() == pytest.approx(token_mean, abs=1e-6)
    assert out.metrics["clip_fraction"].item() == pytest.approx(2 / 5)
    assert out.metrics["ratio_mean"].item() == pytest.approx((1.5 + 0.9 + 0.5 + 1.1 + 1.0) / 5, abs=1e-6)
    assert out.metrics["completion_length"].item() == pytest.approx(2.5)
    assert out.metrics["kl"].item() == 0.0
    out.loss.backward()
    # d loss / d logp_t = -A * r / 5 where unclipped, 0 where the clip is active.
    want_grad = [0.0, -1.0 * 0.9 / 5, 0.0, 2.0 * 1.1 / 5, 2.0 * 1.0 / 5]
    assert logp.grad.tolist() == pytest.approx(want_grad, abs=1e-6)

    seq = GrpoConfig(clip_eps=0.2, loss_norm="sequence")
    seq_mean = ((-1.2 - 0.9) / 2 + (1.6 + 2.2 + 2.0) / 3) / 2  # (-1.05 + 1.9333...) / 2
    assert grpo_sums(logp, toks, seq).finish(seq).loss.item() == pytest.approx(seq_mean, abs=1e-6)
    assert sum(per_token) / 5 == pytest.approx(token_mean)

    # Clip-higher: eps_high 0.6 leaves r=1.5 (A > 0) unclipped: -1.5 instead of -1.2.
    high = GrpoConfig(clip_eps=0.2, clip_eps_high=0.6)
    out = grpo_sums(logp, toks, high).finish(high)
    assert out.loss.item() == pytest.approx((-1.5 - 0.9 + 1.6 + 2.2 + 2.0) / 5, abs=1e-6)
    assert out.metrics["clip_fraction"].item() == pytest.approx(1 / 5)


def test_kl_term_hand_computed():
    row, toks, logp = _hand_case()
    ref = logp.detach() + torch.tensor([0.3, -0.2, 0.0, 1.0, -0.5])
    k3 = [math.exp(d) - d - 1 for d in (0.3, -0.2, 0.0, 1.0, -0.5)]
    cfg = GrpoConfig(kl_coef=0.1)
    out = grpo_sums(logp, toks, cfg, ref).finish(cfg)
    assert out.loss.item() == pytest.approx(0.74 + 0.1 * sum(k3) / 5, abs=1e-6)
    assert out.metrics["kl"].item() == pytest.approx(sum(k3) / 5, abs=1e-6)
    # kl_coef 0 with a reference: reported, not in the loss.
    zero = GrpoConfig()
    out0 = grpo_sums(logp, toks, zero, ref).finish(zero)
    assert out0.loss.item() == pytest.approx(0.74, abs=1e-6) and out0.metrics["kl"].item() > 0
    with pytest.raises(GrpoInputError, match="ref_logprobs"):
        grpo_sums(logp, toks, cfg)


def test_on_policy_ratio_is_one_and_loss_is_minus_mean_advantage():
    row, toks, _ = _hand_case()
    logp = toks.old_logprobs.clone().requires_grad_(True)  # logp == old_logp
    out = grpo_sums(logp, toks, GrpoConfig()).finish(GrpoConfig())
    assert out.metrics["ratio_mean"].item() == 1.0 and out.metrics["clip_fraction"].item() == 0.0
    adv = [1.0, 1.0, -2.0, -2.0, -2.0]
    assert out.loss.item() == pytest.approx(-sum(adv) / 5, abs=1e-7)  # = 0.8
    out.loss.backward()
    assert logp.grad.tolist() == pytest.approx([-a / 5 for a in adv], abs=1e-7)  # the policy gradient


def test_sequence_and_token_norm_differ_iff_lengths_differ():
    tok, seq = GrpoConfig(loss_norm="token"), GrpoConfig(loss_norm="sequence")
    _, toks, logp = _hand_case(requires_grad=False)  # lengths 2 and 3
    assert (
        abs(grpo_sums(logp, toks, tok).finish(tok).loss.item() - grpo_sums(logp, toks, seq).finish(seq).loss.item())
        > 0.1
    )
    _, toks = _row([([-1.0, -2.0, -0.5], 1.0), ([-0.5, -1.5, -3.0], -2.0)])  # both of length 3
    logp = toks.old_logprobs + torch.tensor([0.4, -0.1, 0.05, -0.6, 0.2, 0.0])
    a, b = grpo_sums(logp, toks, tok).finish(tok).loss, grpo_sums(logp, toks, seq).finish(seq).loss
    assert a.item() == pytest.approx(b.item(), abs=1e-6)


def test_completion_logprobs_read_the_previous_position():
    row, toks = _row([([-1.0, -2.0], 1.0), ([-0.5], -1.0)], prompt_len=1)
    # Row: [p0, c0, c1 | p1, c0]; labelled positions 1, 2, 4, predicted by the logits at 0, 1, 3.
    assert row.labels[0].tolist() == [IGNORE_INDEX, 10, 11, IGNORE_INDEX, 10]
    logits = torch.randn(row.length, 128, generator=torch.Generator().manual_seed(0))
    want = torch.log_softmax(logits, -1)[[0, 1, 3], [10, 11, 10]]
    assert torch.allclose(completion_logprobs(logits, row), want, atol=1e-6)
    hot = torch.log_softmax(logits / 0.7, -1)[[0, 1, 3], [10, 11, 10]]
    assert torch.allclose(completion_logprobs(logits[None], row, temperature=0.7), hot, atol=1e-6)


def test_masked_completion_tokens_and_bad_segments():
    seg = grpo_segment([1, 2], [5, 6, 7], [-0.1, -0.2, -0.3], 0.5, completion_mask=[True, False, True])
    assert seg.labels == (IGNORE_INDEX, IGNORE_INDEX, 5, IGNORE_INDEX, 7)
    assert seg.meta[META_OLD_LOGPROBS] == (-0.1, -0.3) and seg.meta[META_ADVANTAGE] == 0.5
    gone = grpo_segment([1], [5], [-0.1], 1.0, completion_mask=[False])  # no token left: not a sequence
    toks = grpo_tokens(pack([seg, gone]))
    assert toks.n_tokens == 2 and toks.n_seqs == 1
    assert toks.old_logprobs.tolist() == pytest.approx([-0.1, -0.3]) and toks.inv_seq_len.tolist() == [0.5, 0.5]
    with pytest.raises(GrpoInputError, match="old log-probs"):
        grpo_segment([1], [5, 6], [-0.1], 1.0)
    with pytest.raises(GrpoInputError, match="prompt token"):
        grpo_segment([], [5], [-0.1], 1.0)
    plain = Segment((1, 2, 3), (IGNORE_INDEX, 2, 3), (), (), 1, 0)
    with pytest.raises(GrpoInputError, match="segment 1 .*grpo_old_logprobs / grpo_advantage"):
        grpo_tokens(pack([seg, plain]))
    with pytest.raises(ValueError, match="loss_norm"):
        GrpoConfig(loss_norm="mean")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="clip_eps"):
        GrpoConfig(clip_eps=0.0)


def test_row_without_completion_tokens_backwards_to_zero():
    seg = grpo_segment([1, 2], [5], [-0.1], 1.0, completion_mask=[False])
    row = pack([seg])
    logits = torch.randn(1, row.length, 16, requires_grad=True)
    out = grpo_loss(logits, row, GrpoConfig())
    out.loss.backward()
    assert out.loss.item() == 0.0 and torch.isfinite(logits.grad).all() and logits.grad.abs().sum() == 0


# ---- packed vs unpacked on the tiny model ------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa")
    return model.eval()


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _samples(model):
    """Two prompts x (3, 2) samples of different lengths, rewards with one zero-variance group, old
    log-probs a noisy copy of the model's (so both clip sides are hit) and a noisy reference."""
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    lengths = [(7, 5), (7, 9), (7, 3), (4, 6), (4, 11)]  # (prompt, completion)
    prompts = [torch.randint(0, vocab, (7,), generator=g).tolist(), torch.randint(0, vocab, (4,), generator=g).tolist()]
    adv = group_advantages([[1.0, 0.0, 0.25], [0.5, 0.5]])
    assert adv[3:].abs().sum() == 0
    adv = adv.tolist()
    segs, refs = [], []
    for i, (p, c) in enumerate(lengths):
        prompt = prompts[0] if p == 7 else prompts[1]
        completion = torch.randint(0, vocab, (c,), generator=g).tolist()
        probe = pack([grpo_segment(prompt, completion, [0.0] * c, 0.0)])
        with torch.no_grad():
            lp = completion_logprobs(model(**probe.model_inputs()).logits, probe)
        old = (lp + (torch.rand(c, generator=g) - 0.5) * 0.8).clamp(max=-1e-4).tolist()
        segs.append(grpo_segment(prompt, completion, old, adv[i], meta={"sample": i}))
        refs.append(lp + (torch.rand(c, generator=g) - 0.5) * 0.6)
    return segs, refs


@pytest.mark.parametrize(
    "cfg",
    [
        GrpoConfig(),
        GrpoConfig(loss_norm="sequence", kl_coef=0.05),
        GrpoConfig(clip_eps=0.1, clip_eps_high=0.3, kl_coef=0.2, scale_rewards=False),
        GrpoConfig(loss_norm="sequence", correction="mis", correction_high=1.5),
    ],
    ids=["token", "sequence-kl", "token-kl-cliphigher", "sequence-mis"],
)
def test_packed_grpo_equals_sequences_one_by_one(tiny_model, cfg):
    torch.manual_seed(0)
    model = tiny_model
    segs, refs = _samples(model)

    # Unpacked: each sample alone, sums pooled.
    model.zero_grad()
    total = None
    for s, ref in zip(segs, refs, strict=True):
        r = pack([s])
        sums = grpo_row_sums(model(**r.model_inputs()).logits, r, cfg, ref)
        total = sums if total is None else total + sums
    unpacked = total.finish(cfg)
    unpacked.loss.backward()
    unpacked_grads = _grads(model)

    # Packed: one row, the samples in another order (their old log-probs and advantages travel in meta).
    model.zero_grad()
    order = [3, 0, 4, 2, 1]
    row = pack([segs[i] for i in order], packing_length=256)
    assert [info.meta["sample"] for info in row.segments] == order
    packed_logits = model(**row.model_inputs()).logits
    packed = grpo_loss(packed_logits, row, cfg, torch.cat([refs[i] for i in order]))
    packed.loss.backward()
    packed_grads = _grads(model)

    if cfg.correction == "none":
        assert packed.metrics["clip_fraction"].item() > 0  # the clip is exercised, on real logits
    else:  # the trust region is against the learner's own policy (ratio 1); the correction is what acts
        assert packed.metrics["clip_fraction"].item() == 0 and 0 < packed.metrics["corrected_fraction"].item() < 1
    loss_diff = abs(packed.loss.item() - unpacked.loss.item())
    assert loss_diff <= 1e-5 and packed.loss.item() != 0.0
    for name in ("clip_fraction", "ratio_mean", "kl", "completion_length"):
        assert packed.metrics[name].item() == pytest.approx(unpacked.metrics[name].item(), abs=1e-5), name
    assert packed_grads.keys() == unpacked_grads.keys() and packed_grads
    worst = max(float((packed_grads[n] - unpacked_grads[n]).abs().max()) for n in packed_grads)
    assert worst <= 1e-4
    print(
        f"packed vs unpacked ({cfg.loss_norm}, kl {cfg.kl_coef}): loss {packed.loss.item():.6f}, "
        f"diff {loss_diff:.2e}, grad diff {worst:.2e}, clip {packed.metrics['clip_fraction'].item():.2f}"
    )

    # Several rows, each backwarded alone and normalised by the step's totals (what a trainer does).
    model.zero_grad()
    packer = Packer(packing_length=30, packing_buffer=8)
    packer.add(segs)
    rows = []
    while (r := packer.next_row()) is not None:
        rows.append(r)
    assert len(rows) > 1
    toks = [grpo_tokens(r) for r in rows]
    n_tok, n_seq = sum(t.n_tokens for t in toks), sum(t.n_seqs for t in toks)
    by_rows = 0.0
    for r, t in zip(rows, toks, strict=True):
        ref = torch.cat([refs[info.meta["sample"]] for info in r.segments])
        out = grpo_row_sums(model(**r.model_inputs()).logits, r, cfg, ref, tokens=t).finish(cfg, n_tok, n_seq)
        out.loss.backward()
        by_rows += out.loss.item()
    assert abs(by_rows - unpacked.loss.item()) <= 1e-5
    row_grads = _grads(model)
    assert max(float((row_grads[n] - unpacked_grads[n]).abs().max()) for n in row_grads) <= 1e-4

    # Control: without restarting position ids the segments attend to each other -> a different loss.
    flat = torch.arange(row.length)[None]
    with torch.no_grad():
        leaky_logits = model(input_ids=row.input_ids, position_ids=flat, use_cache=False).logits
    leaky = grpo_loss(leaky_logits, row, cfg, torch.cat([refs[i] for i in order]))
    assert abs(leaky.loss.item() - unpacked.loss.item()) > 1e-4


def test_kl_is_zero_when_policy_is_reference(tiny_model):
    segs, _ = _samples(tiny_model)
    row = pack(segs)
    logits = tiny_model(**row.model_inputs()).logits
    logp = completion_logprobs(logits, row)
    toks = grpo_tokens(row)
    with_kl, without = GrpoConfig(kl_coef=0.5), GrpoConfig(kl_coef=0.0)
    a = grpo_sums(logp, toks, with_kl, logp.detach()).finish(with_kl)
    b = grpo_sums(logp, toks, without).finish(without)
    assert a.metrics["kl"].item() == 0.0
    assert a.loss.item() == b.loss.item()
    ga = torch.autograd.grad(a.loss, logp, retain_graph=True)[0]
    gb = torch.autograd.grad(b.loss, logp)[0]
    assert torch.equal(ga, gb)  # k3's gradient at ref == logp is exactly 0 as well


def test_tokens_of_a_hand_built_row():
    # GrpoTokens fields line up with the labelled positions in row order.
    row, toks = _row([([-1.0, -2.0], 1.0), ([-0.5, -1.5, -3.0], -2.0)])
    assert isinstance(toks, GrpoTokens)
    assert toks.old_logprobs.tolist() == [-1.0, -2.0, -0.5, -1.5, -3.0]
    assert toks.inv_seq_len.tolist() == pytest.approx([0.5, 0.5, 1 / 3, 1 / 3, 1 / 3])
    assert int((row.labels != IGNORE_INDEX).sum()) == toks.n_tokens


# ---- train/inference mismatch corrections by hand ---------------------------------------------
# The hand case's learner/behaviour ratios rho_t are RATIOS: (1.5, 0.9 | 0.5, 1.1, 1.0), advantages (+1, +1 | -2 x3).
# With a correction the trust region is taken against the learner's own (detached) log-probs: r_t = 1 in value,
# so loss_t = -w_t * A and d loss / d logp_t = -w_t * A / 5 (token norm), w_t the correction's weight.


def _corrected(cfg: GrpoConfig):
    _, toks, logp = _hand_case()
    out = grpo_sums(logp, toks, cfg).finish(cfg)
    out.loss.backward()
    return out, logp.grad.tolist()


def test_mismatch_kl_is_reported_and_none_leaves_the_loss_alone():
    # k3 of KL(behaviour || learner) per token: rho - log(rho) - 1, averaged over the 5 tokens.
    k3 = [0.5 - 0.4054651, -0.1 + 0.1053605, -0.5 + 0.6931472, 0.1 - 0.0953102, 0.0]
    out, grad = _corrected(GrpoConfig())
    assert out.metrics["mismatch_kl"].item() == pytest.approx(sum(k3) / 5, abs=1e-6)  # 0.0595465
    assert out.loss.item() == pytest.approx(0.74, abs=1e-6)  # the plain clipped loss of test_clipped_loss_hand_computed
    assert out.metrics["is_weight_mean"].item() == 1.0 and out.metrics["corrected_fraction"].item() == 0.0
    # On policy: no mismatch.
    _, toks, _ = _hand_case()
    same = grpo_sums(toks.old_logprobs.clone(), toks, GrpoConfig()).finish(GrpoConfig())
    assert same.metrics["mismatch_kl"].item() == 0.0
    # Every token twice as likely to the learner: 2 - log 2 - 1 per token (the k1 estimate would read -log 2 < 0).
    double = grpo_sums(toks.old_logprobs + math.log(2.0), toks, GrpoConfig()).finish(GrpoConfig())
    assert double.metrics["mismatch_kl"].item() == pytest.approx(1.0 - math.log(2.0), abs=1e-6)


def test_tis_truncates_the_token_ratio_from_above():
    out, grad = _corrected(GrpoConfig(correction="tis", correction_high=1.2))
    w = [1.2, 0.9, 0.5, 1.1, 1.0]  # 1.5 truncated to 1.2
    adv = [1.0, 1.0, -2.0, -2.0, -2.0]
    assert out.loss.item() == pytest.approx(sum(-wi * a for wi, a in zip(w, adv, strict=True)) / 5, abs=1e-6)  # 0.62
    assert grad == pytest.approx([-wi * a / 5 for wi, a in zip(w, adv, strict=True)], abs=1e-6)
    assert out.metrics["is_weight_mean"].item() == pytest.approx(4.7 / 5, abs=1e-6)
    assert out.metrics["corrected_fraction"].item() == pytest.approx(1 / 5)
    assert out.metrics["clip_fraction"].item() == 0.0  # the ratio to the learner's own policy is 1
    # The default cap is 2: nothing truncated here, every weight is rho.
    out2, _ = _corrected(GrpoConfig(correction="tis"))
    assert out2.loss.item() == pytest.approx((-1.5 - 0.9 + 1.0 + 2.2 + 2.0) / 5, abs=1e-6)


def test_icepop_masks_both_tails_of_the_token_ratio():
    out, grad = _corrected(GrpoConfig(correction="icepop", correction_low=0.8, correction_high=1.4))
    w = [0.0, 0.9, 0.0, 1.1, 1.0]  # 1.5 > 1.4 and 0.5 < 0.8 masked; the rest weighted by rho
    adv = [1.0, 1.0, -2.0, -2.0, -2.0]
    assert out.loss.item() == pytest.approx(3.3 / 5, abs=1e-6)
    assert grad == pytest.approx([-wi * a / 5 for wi, a in zip(w, adv, strict=True)], abs=1e-6)
    assert out.metrics["corrected_fraction"].item() == pytest.approx(2 / 5)
    # Defaults [0.5, 5]: 0.5 is inside (the band is closed), nothing masked.
    out2, _ = _corrected(GrpoConfig(correction="icepop"))
    assert out2.metrics["corrected_fraction"].item() == 0.0


def test_mis_masks_whole_answers_by_their_sequence_ratio():
    # Sequence ratios: 1.5 * 0.9 = 1.35 and 0.5 * 1.1 * 1.0 = 0.55.
    out, grad = _corrected(GrpoConfig(correction="mis", correction_high=1.2))
    w = [0.0, 0.0, 0.55, 0.55, 0.55]  # answer 0 (1.35 > 1.2) dropped whole; answer 1 weighted by 0.55
    adv = [1.0, 1.0, -2.0, -2.0, -2.0]
    assert out.loss.item() == pytest.approx(3 * 2 * 0.55 / 5, abs=1e-6)  # 0.66
    assert grad == pytest.approx([-wi * a / 5 for wi, a in zip(w, adv, strict=True)], abs=1e-6)
    assert out.metrics["corrected_fraction"].item() == pytest.approx(2 / 5)
    out2, _ = _corrected(GrpoConfig(correction="mis"))  # default [0, 2]: both kept
    assert out2.loss.item() == pytest.approx((-2 * 1.35 + 6 * 0.55) / 5, abs=1e-6)  # 0.12
    lower, _ = _corrected(GrpoConfig(correction="mis", correction_low=0.6))  # 0.55 < 0.6: answer 1 dropped
    assert lower.loss.item() == pytest.approx(-2 * 1.35 / 5, abs=1e-6)
    # Sequence norm: each answer's token mean, then the mean over answers.
    seq = GrpoConfig(correction="mis", loss_norm="sequence")
    _, toks, logp = _hand_case()
    assert grpo_sums(logp, toks, seq).finish(seq).loss.item() == pytest.approx((-1.35 + 1.1) / 2, abs=1e-6)


def test_correction_thresholds_are_validated():
    with pytest.raises(ValueError, match="need a correction"):
        GrpoConfig(correction_high=2.0)
    with pytest.raises(ValueError, match="from above only"):
        GrpoConfig(correction="tis", correction_low=0.5)
    with pytest.raises(ValueError, match="correction_high must be > 1"):
        GrpoConfig(correction="icepop", correction_high=0.9)
    with pytest.raises(ValueError, match=r"correction_low must be in \[0, 1\)"):
        GrpoConfig(correction="mis", correction_low=1.0)
    with pytest.raises(ValueError, match="correction must be one of"):
        GrpoConfig(correction="ppo")  # type: ignore[arg-type]
    assert GrpoConfig(correction="icepop").correction_bounds == (0.5, 5.0)
    assert GrpoConfig(correction="mis", correction_high=3.0).correction_bounds == (0.0, 3.0)


# ---- sampling rules (learner/train/objectives/grpo.py) ----------------------------------------


def test_overlong_penalty_ramps_over_the_buffer():
    from learner.train.objectives.grpo import overlong_penalty

    # max_tokens 10, buffer 4: free up to 6 tokens, then -1/4 per token, -1 at 10 (and past it).
    got = [overlong_penalty(n, 10, 4, 1.0) for n in (1, 6, 7, 8, 10, 12)]
    assert got == pytest.approx([0.0, 0.0, -0.25, -0.5, -1.0, -1.0])
    assert overlong_penalty(9, 10, 4, 2.0) == pytest.approx(-1.5)
    with pytest.raises(ValueError, match="buffer"):
        overlong_penalty(5, 10, 10, 1.0)


def test_flat_groups_are_groups_of_equal_rewards():
    from learner.train.objectives.grpo import flat_groups

    assert flat_groups([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 2.0, 2.0], 2) == [True, False, True, True]
    with pytest.raises(ValueError, match="groups of 3"):
        flat_groups([1.0, 2.0], 3)


def test_correction_none_is_bit_for_bit_the_plain_clipped_loss():
    # Default runs keep their numbers: the loss and its gradient equal the PPO-clip formula computed directly.
    g = torch.Generator().manual_seed(3)
    _, toks = _row([([-0.3 * (j + 1) for j in range(7)], 1.3), ([-0.2] * 5, -0.7), ([-1.1] * 9, 0.4)])
    base = toks.old_logprobs + (torch.rand(toks.n_tokens, generator=g) - 0.5) * 0.6
    cfg = GrpoConfig(clip_eps=0.2, clip_eps_high=0.28)
    a = base.clone().requires_grad_(True)
    out = grpo_sums(a, toks, cfg).finish(cfg)
    out.loss.backward()
    b = base.clone().requires_grad_(True)
    r = torch.exp(b - toks.old_logprobs)
    want = -torch.minimum(r * toks.advantages, r.clamp(0.8, 1.28) * toks.advantages).sum() / toks.n_tokens
    want.backward()
    assert torch.equal(out.loss, want) and torch.equal(a.grad, b.grad)
