"""The ledger of studies/method/method_compare.py: what every run's evaluations leave on disk, and how it is read back.

Three files per grid, side by side in the output folder:
- NAME.csv: one row per held-out evaluation of every run (COLUMNS: the run's KEY, the step, FIGURES). A run whose
  final row is there is done, so an interrupted grid resumes where it stopped (`done_runs`).
- NAME-records.csv: each final evaluation's label-aware counts per held-out record (matched, false positives, false
  negatives): what the paired bootstrap of F1 draws from.
- NAME-detections.jsonl.gz: each final evaluation's boxes per record (ground truth, and the predictions in the order
  written) and the images' sizes, one JSON line per run: what the paired bootstrap of COCO mAP draws from.
A later run of the same key replaces an earlier one when read back. Appending is the only write: nothing here
rewrites a ledger.
"""

from __future__ import annotations

import csv
import gzip
import json
import math
from collections.abc import Iterable, Sequence
from pathlib import Path

from paired import RecordMatches, record_matches

# The arms a grid trains (studies/method/method_compare.py says what each is), in the order reports list them.
ARMS = ("sft", "gen1", "gen2", "gen2_ref", "gen2_rows", "gen2_b")
KEY = ("setting", "arm", "seed", "steps", "warm", "heldout", "ratio")
FIGURES = (
    "f1",
    "f1_geometry",
    "precision",
    "recall",
    "map",
    "map_agnostic",
    "map_50",
    "truncation_rate",
    "duplicate_rate",
    "predicted_per_gt",
    "predicted_per_answer",
    "gt_per_record",
    "train_truncation_rate",
    "train_duplicate_rate",
    "train_predicted_per_gt",
    "tokens_trained",
    "wall_s",
)
COLUMNS = (*KEY, "step", *FIGURES)


def detections_of(ev) -> dict:
    """An evaluation's boxes per record, for the detections ledger: ground truth and predictions (in the order
    written, which ranks them) as [label, x1, y1, x2, y2] in pixels, and the records' [width, height]."""
    from learner.data.episode import ground_truth_detections
    from learner.evaluation.coco_map import boxes_from_detections

    def rows(boxes) -> list[list]:
        return [[b.label, *b.xyxy] for b in boxes]

    return {
        "sizes": [[r.width, r.height] for r in ev.records],
        "truth": [rows(boxes_from_detections(ground_truth_detections(r), rank_by_order=False)) for r in ev.records],
        "predicted": [rows(boxes_from_detections(p)) for p in ev.predictions],
    }


def read_rows(paths: list[Path]) -> list[dict]:
    rows = []
    for path in paths:
        if not path.exists():
            continue
        with path.open(newline="") as f:
            for raw in csv.DictReader(f):
                row: dict = {k: raw[k] for k in ("setting", "arm")}
                for k in ("seed", "steps", "warm", "heldout", "step", "tokens_trained"):
                    row[k] = int(raw[k])
                for k in ("ratio", *FIGURES):
                    if k != "tokens_trained":
                        row[k] = float(raw[k]) if raw.get(k) not in (None, "") else math.nan
                rows.append(row)
    return rows


def _cell(value: object) -> object:
    """A CSV cell: floats to 6 significant digits (what `key_of` reads back), the rest as they are."""
    return f"{value:.6g}" if isinstance(value, float) else value


def _append_csv(path: Path, header: Sequence[str], lines: Iterable[list]) -> None:
    """Append `lines` to the CSV at `path`, its header first when the file is new."""
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists()
    with path.open("a", newline="") as f:
        w = csv.writer(f)
        if new:
            w.writerow(header)
        w.writerows(lines)


def append_rows(path: Path, rows: list[dict]) -> None:
    _append_csv(path, COLUMNS, ([_cell(row[k]) for k in COLUMNS] for row in rows))


RECORD_COLUMNS = (*KEY, "step", "record", "matched", "fp", "fn")


def is_final(row: dict) -> bool:
    """Whether a ledger row is its run's last evaluation (a warm start's: its step `warm`)."""
    return row["step"] == (row["warm"] if row["arm"] == "warm" else row["steps"])


def records_ledger(ledger: Path) -> Path:
    """Beside OUT/NAME.csv: OUT/NAME-records.csv, each final evaluation's label-aware counts per held-out record."""
    return ledger.with_name(f"{ledger.stem}-records.csv")


def append_record_rows(path: Path, rows: list[dict]) -> None:
    """The per-record counts of the final evaluations among `rows` (a warm start's: its step `warm`)."""
    finals = [r for r in rows if is_final(r) and r.get("per_record")]
    if not finals:
        return
    _append_csv(
        path,
        RECORD_COLUMNS,
        (
            [*(_cell(r[k]) for k in (*KEY, "step")), i, m, fp, fn]
            for r in finals
            for i, (m, fp, fn) in enumerate(r["per_record"])
        ),
    )


def detections_ledger(ledger: Path) -> Path:
    """Beside OUT/NAME.csv: OUT/NAME-detections.jsonl.gz, each final evaluation's boxes per held-out record (what
    a bootstrap of COCO mAP needs), one JSON line per run, gzip members appended."""
    return ledger.with_name(f"{ledger.stem}-detections.jsonl.gz")


def append_detection_rows(path: Path, rows: list[dict]) -> None:
    """The detections of the final evaluations among `rows`, as `append_record_rows` keeps their counts."""
    finals = [r for r in rows if is_final(r) and r.get("detections")]
    if not finals:
        return
    with gzip.open(path, "at") as f:
        for r in finals:
            f.write(json.dumps({"key": [r[k] for k in KEY], "step": r["step"], **r["detections"]}) + "\n")


def read_detection_docs(path: Path) -> dict[tuple, dict]:
    """Run key (KEY) -> its final evaluation's detections line as written (`key`, `step`, `sizes`, `truth`,
    `predicted`; a later line of the same key replaces an earlier one)."""
    if not path.exists():
        return {}
    docs = {}
    with gzip.open(path, "rt") as f:
        for line in f:
            doc = json.loads(line)
            docs[key_of(dict(zip(KEY, doc["key"], strict=True)))] = doc
    return docs


def read_detection_rows(path: Path) -> dict[tuple, RecordMatches]:
    """Run key (KEY) -> its final evaluation's detections, matched (read_detection_docs)."""
    return {k: record_matches(doc) for k, doc in read_detection_docs(path).items()}


def key_of(row: dict) -> tuple:
    """A run's key (KEY) from a ledger row, read back from the CSV or as written: the same tuple either way."""
    return tuple(
        round(float(row[k]), 6)
        if k == "ratio"
        else int(row[k])
        if k in ("seed", "steps", "warm", "heldout")
        else row[k]
        for k in KEY
    )


def read_record_rows(path: Path) -> dict[tuple, list[tuple[int, int, int]]]:
    """Run key (KEY) -> its final evaluation's (matched, fp, fn) per record (a later run of the same key replaces
    an earlier one)."""
    out: dict[tuple, dict[int, tuple[int, int, int]]] = {}
    if not path.exists():
        return {}
    with path.open(newline="") as f:
        for raw in csv.DictReader(f):
            out.setdefault(key_of(raw), {})[int(raw["record"])] = (int(raw["matched"]), int(raw["fp"]), int(raw["fn"]))
    return {k: [v[i] for i in sorted(v)] for k, v in out.items()}


def done_runs(rows: list[dict]) -> set[tuple]:
    """Keys of the runs whose last evaluation is in the ledger (a warm start's last step is `warm`)."""
    return {key_of(r) for r in rows if is_final(r)}


def other_ledgers(ledger: Path) -> list[dict]:
    """The rows of every other method_compare ledger in the ledger's folder (for `estimate`; one of an older
    layout, without the columns read here, is passed over)."""
    out: list[dict] = []
    for path in sorted(ledger.parent.glob("method_compare*.csv")):
        if path != ledger and not path.stem.endswith("-records"):
            try:
                out += read_rows([path])
            except (KeyError, ValueError):
                continue
    return out


def final_rows(rows: list[dict]) -> dict[tuple[str, str], list[dict]]:
    """(setting, arm) -> each seed's last row (arm `warm`: the shared start), the newest plan's only."""
    out: dict[tuple[str, str], dict[int, dict]] = {}
    for r in rows:
        if is_final(r):
            out.setdefault((r["setting"], r["arm"]), {})[r["seed"]] = r  # a later row of the same seed wins
    return {k: [v[s] for s in sorted(v)] for k, v in out.items()}
