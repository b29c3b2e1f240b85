"""`rmsft data from-coco` on COCO files as they come (an issue's list): an image-list file with no annotations,
duplicate category ids, .jsonl.gz output, a folder as OUT, panoptic and captions files, annotations lost with a
skipped image, `iscrowd: "1"`, `width: 500.0`, labelme's `_background_` category in `{categories}`; and
`rmsft data check`, which loads a records file as a job does. Each test fails without its fix. No model, no vLLM."""

from __future__ import annotations

import copy
import gzip
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from learner.data import coco
from learner.data.check import check_records
from learner.data.coco import CocoError, CocoOptions, convert_coco
from learner.data.dataset import load_dataset

ROOT = Path(__file__).resolve().parents[2]

# Shaped like a real instances file (info, licenses, supercategory, area, segmentation), two images, three objects.
BASE: dict[str, Any] = {
    "info": {"description": "test", "version": "1.0"},
    "licenses": [],
    "images": [
        {"id": 1, "file_name": "a.png", "width": 64, "height": 48, "license": 0},
        {"id": 2, "file_name": "b.png", "width": 32, "height": 32, "license": 0},
    ],
    "annotations": [
        {
            "id": 1,
            "image_id": 1,
            "category_id": 1,
            "bbox": [4, 4, 10, 10],
            "area": 100,
            "iscrowd": 0,
            "segmentation": [[4, 4, 14, 4, 14, 14, 4, 14]],
        },
        {
            "id": 2,
            "image_id": 1,
            "category_id": 2,
            "bbox": [20, 20, 10, 10],
            "area": 100,
            "iscrowd": 0,
            "segmentation": [],
        },
        {"id": 3, "image_id": 2, "category_id": 1, "bbox": [1, 1, 5, 5], "area": 25, "iscrowd": 0},
    ],
    "categories": [
        {"id": 1, "name": "person", "supercategory": "person"},
        {"id": 2, "name": "car", "supercategory": "vehicle"},
    ],
}


def _doc() -> dict[str, Any]:
    return copy.deepcopy(BASE)


def _files(tmp: Path, doc: dict[str, Any], pngs: dict[str, tuple[int, int]] | None = None) -> tuple[Path, Path]:
    """The annotation file and an images folder with tiny PNGs (default: BASE's two images)."""
    images = tmp / "images"
    images.mkdir(exist_ok=True)
    for name, size in (pngs if pngs is not None else {"a.png": (64, 48), "b.png": (32, 32)}).items():
        Image.new("RGB", size, (90, 160, 30)).save(images / name, format="PNG")
    ann = tmp / "instances.json"
    ann.write_text(json.dumps(doc))
    return ann, images


def _records(path: Path) -> list[dict[str, Any]]:
    if path.name.endswith(".gz"):
        with gzip.open(path, "rt") as f:
            text = f.read()
    else:
        text = path.read_text()
    return [json.loads(line) for line in text.splitlines()]


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rmsft_cli", "data", *args], capture_output=True, text=True, cwd=ROOT, timeout=120
    )


# 1 ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("annotations", ["absent", "empty"])
def test_file_without_annotations_is_refused_unless_allowed(tmp_path: Path, annotations: str) -> None:
    """image_info_test2017.json has images and categories but no annotations: every record would be empty."""
    doc = _doc()
    if annotations == "absent":
        del doc["annotations"]
    else:
        doc["annotations"] = []
    ann, images = _files(tmp_path, doc)
    out = tmp_path / "train.jsonl"
    with pytest.raises(CocoError, match=r"has no annotations \(it looks like an image-list or test-split file\)"):
        convert_coco(ann, images, out)
    assert not out.exists() and not list(tmp_path.glob("*.tmp"))

    summary = convert_coco(ann, images, out, CocoOptions(allow_no_annotations=True))
    assert (summary.records, summary.objects, summary.empty_records) == (2, 0, 2)
    assert [r["objects"] for r in _records(out)] == [[], []]


# 2 ---------------------------------------------------------------------------------------------------------------


def test_duplicate_category_ids_are_refused_naming_both(tmp_path: Path) -> None:
    doc = _doc()
    doc["categories"].append({"id": 1, "name": "cyclist", "supercategory": "person"})
    ann, images = _files(tmp_path, doc)
    with pytest.raises(CocoError, match=r"categories\[2\]\.id 1 is used by 'person' and 'cyclist'"):
        convert_coco(ann, images, tmp_path / "train.jsonl")
    assert not (tmp_path / "train.jsonl").exists()


# 3 ---------------------------------------------------------------------------------------------------------------


def test_gzip_output_loads_through_the_learners_loader(tmp_path: Path) -> None:
    """docs/data.md and the job spec take .jsonl.gz, and learner/data/records.py reads it through gzip."""
    ann, images = _files(tmp_path, _doc())
    out = tmp_path / "data" / "train.jsonl.gz"
    summary = convert_coco(ann, images, out)
    assert (summary.records, summary.objects) == (2, 3)
    raw = out.read_bytes()
    assert raw[:2] == b"\x1f\x8b"  # gzip, not plain text under a .gz name
    assert b"train.jsonl\x00" in raw[:40] and b".tmp" not in raw[:40]  # OUT's name in the header, not the temp one
    assert not list(out.parent.glob("*.tmp"))
    records, store = load_dataset(out, None, 10**8)  # the learner's own loader, images checked
    assert [r.id for r in records] == ["1", "2"]
    assert [o.desc for o in records[0].objects] == ["person", "car"]
    assert store.load(records[0])[0].width == 64
    plain = tmp_path / "data" / "train.jsonl"
    convert_coco(ann, images, plain)
    assert _records(out) == _records(plain)
    before = out.read_bytes()
    convert_coco(ann, images, out)
    assert out.read_bytes() == before  # mtime 0: the same conversion writes the same bytes


# 4 ---------------------------------------------------------------------------------------------------------------


def test_output_folder_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    ann, images = _files(tmp_path, _doc())
    folder = tmp_path / "out.jsonl"
    folder.mkdir()
    before = sorted(tmp_path.rglob("*"))
    with pytest.raises(CocoError, match=r"out.jsonl: is a folder; OUT is the file to write"):
        convert_coco(ann, images, folder)
    assert sorted(tmp_path.rglob("*")) == before  # no out.jsonl.tmp
    with pytest.raises(CocoError, match=r"instances.json is a file, not a folder"):
        convert_coco(ann, images, ann / "train.jsonl")
    assert sorted(tmp_path.rglob("*")) == before


# 5 ---------------------------------------------------------------------------------------------------------------


PANOPTIC = {
    "info": {},
    "licenses": [],
    "images": [{"id": 1, "file_name": "a.jpg", "width": 64, "height": 48}],
    "annotations": [
        {
            "image_id": 1,
            "file_name": "a.png",
            "segments_info": [{"id": 3226956, "category_id": 1, "iscrowd": 0, "bbox": [4, 4, 10, 10], "area": 100}],
        }
    ],
    "categories": [{"id": 1, "name": "person", "supercategory": "person", "isthing": 1, "color": [220, 20, 60]}],
}
CAPTIONS = {  # captions_train2017.json has no categories at all
    "info": {},
    "licenses": [],
    "images": [{"id": 1, "file_name": "a.jpg", "width": 64, "height": 48}],
    "annotations": [{"image_id": 1, "id": 48, "caption": "A person next to a car."}],
}


@pytest.mark.parametrize(
    ("doc", "kind"),
    [(PANOPTIC, "panoptic"), (CAPTIONS, "captions"), ({**CAPTIONS, "categories": PANOPTIC["categories"]}, "captions")],
    ids=["panoptic", "captions", "captions-with-categories"],
)
def test_panoptic_and_captions_files_are_named(tmp_path: Path, doc: dict[str, Any], kind: str) -> None:
    ann, images = _files(tmp_path, doc, pngs={})
    with pytest.raises(CocoError, match=rf"this is not an instances \(detection\) file: it looks like a {kind} file"):
        convert_coco(ann, images, tmp_path / "train.jsonl")


# 6 ---------------------------------------------------------------------------------------------------------------


def test_annotations_of_skipped_images_are_counted(tmp_path: Path) -> None:
    doc = _doc()
    doc["images"].append({"id": 3, "file_name": "gone.png", "width": 32, "height": 32})
    doc["annotations"] += [
        {"id": 4, "image_id": 3, "category_id": 1, "bbox": [1, 1, 5, 5], "iscrowd": 0},
        {"id": 5, "image_id": 3, "category_id": 2, "bbox": [8, 8, 5, 5], "iscrowd": 0},
        {"id": 6, "image_id": 3, "category_id": 2, "bbox": [0, 0, 32, 32], "iscrowd": 1},  # a skipped annotation
    ]
    ann, images = _files(tmp_path, doc)
    summary = convert_coco(ann, images, tmp_path / "train.jsonl")
    assert summary.skipped_images == {coco.IMG_MISSING: 1}
    assert summary.annotations_of_skipped_images == 2  # the crowd one is counted once, as a skipped annotation
    assert "skipped images: 1 (2 annotations of them not written)" in summary.lines()
    # Every annotation read is accounted for exactly once.
    skipped = sum(summary.skipped_annotations.values())
    assert summary.objects + skipped + summary.annotations_of_skipped_images == summary.annotations_in == 6


# 7 ---------------------------------------------------------------------------------------------------------------


def test_iscrowd_as_a_string_is_a_crowd_and_other_values_are_refused(tmp_path: Path) -> None:
    doc = _doc()
    doc["annotations"][0]["iscrowd"] = "1"  # some exporters write strings
    doc["annotations"][1]["iscrowd"] = True
    doc["annotations"][2]["iscrowd"] = "0"
    ann, images = _files(tmp_path, doc)
    out = tmp_path / "train.jsonl"
    summary = convert_coco(ann, images, out)
    assert summary.skipped_annotations == {coco.SKIP_CROWD: 2}
    assert [len(r["objects"]) for r in _records(out)] == [1]  # a.png had only crowd regions: skipped
    for bad in (2, "yes", [1]):
        doc["annotations"][1]["iscrowd"] = bad
        ann.write_text(json.dumps(doc))
        said = re.escape(f"annotations[1] (annotation id 2): iscrowd {bad!r} is neither 0 nor 1")
        with pytest.raises(CocoError, match=said):
            convert_coco(ann, images, out)


# 8 ---------------------------------------------------------------------------------------------------------------


def test_integral_float_sizes_are_sizes_and_others_are_refused(tmp_path: Path) -> None:
    doc = _doc()
    doc["images"][0].update(width=64.0, height=48.0)
    ann, images = _files(tmp_path, doc)
    out = tmp_path / "train.jsonl"
    convert_coco(ann, images, out)
    first = _records(out)[0]
    assert (first["width"], first["height"]) == (64, 48) and isinstance(first["width"], int)
    load_dataset(out, None, 10**8)
    for key, bad, said in (
        ("width", 64.5, "is not a whole number of pixels"),
        ("height", 0.0, "must be >= 1"),
        ("height", -48, "must be >= 1"),
        ("width", "64", "is missing or not a number"),
    ):
        broken = _doc()
        broken["images"][1][key] = bad
        ann.write_text(json.dumps(broken))
        with pytest.raises(CocoError, match=rf"images\[1\] \(id 2, b.png\): {key} .*{said}"):
            convert_coco(ann, images, out)


# 9 ---------------------------------------------------------------------------------------------------------------


def test_categories_placeholder_names_only_categories_of_written_objects(tmp_path: Path) -> None:
    doc = _doc()
    doc["categories"] = [
        {"id": 0, "name": "_background_", "supercategory": None},
        *doc["categories"],
        {"id": 3, "name": "dog", "supercategory": "animal"},
    ]  # labelme2coco writes category 0 so
    doc["images"].append({"id": 3, "file_name": "gone.png", "width": 32, "height": 32})
    doc["annotations"].append({"id": 4, "image_id": 3, "category_id": 3, "bbox": [1, 1, 5, 5], "iscrowd": 0})
    ann, images = _files(tmp_path, doc)
    out = tmp_path / "train.jsonl"
    summary = convert_coco(ann, images, out, CocoOptions(prompt="Find every {categories}."))
    # dog's only object went with its missing image; _background_ has none at all.
    assert {r["messages"][0]["content"] for r in _records(out)} == {"Find every car, person."}
    assert summary.unused_categories == ["_background_", "dog"]
    assert "{categories} leaves out 2 categories no written object has: _background_, dog" in summary.lines()
    # The default prompt has no placeholder: nothing to say about it.
    assert not any(line.startswith("{categories}") for line in convert_coco(ann, images, out).lines())


# 10 --------------------------------------------------------------------------------------------------------------


def test_check_records_counts_labels_images_and_refusals(tmp_path: Path) -> None:
    doc = _doc()
    doc["images"].append({"id": 3, "file_name": "c.png", "width": 32, "height": 32})  # a negative example
    ann, images = _files(tmp_path, doc, pngs={"a.png": (64, 48), "b.png": (32, 32), "c.png": (32, 32)})
    out = tmp_path / "train.jsonl.gz"
    convert_coco(ann, images, out, CocoOptions(paths="images"))
    report = check_records(out, images)
    assert report.accepted, report.refusals
    counts = (report.records, report.objects, report.polygons, report.empty_records, report.most_objects)
    assert counts == (3, 3, 1, 1, 2)
    assert report.labels == {"person": 2, "car": 1}
    assert (report.image_refs, report.images, report.found, report.missing) == (3, 3, 3, [])
    assert report.sizes == {(64, 48): 1, (32, 32): 2}
    lines = report.lines()
    assert lines[-1] == "a job would accept this file"
    assert "objects per record: 1.00 on average, 2 at most" in lines
    assert "  sizes: 2 distinct, 32x32 to 64x48 pixels; most common: 32x32 (2), 64x48 (1)" in lines

    # Without --images the paths resolve against the file's folder, as an unset image_root does: all missing.
    report = check_records(out)
    assert not report.accepted and report.found == 0 and len(report.missing) == 3
    assert "record '1', image 'a.png': file" in report.refusals[0] and "does not exist" in report.refusals[0]
    assert check_records(out, images, max_images_per_prompt=0).refusals == [
        "3 records carry more than spec.model.vision.maxImagesPerPrompt=0 images (first: '1')"
    ]


def test_cli_refusals_are_one_line_and_data_check_prints_unwrapped(tmp_path: Path) -> None:
    """Through `python -m rmsft_cli`, as a user runs it: refusals exit 2 with one line and no traceback; `data
    check` exits 0 for a file a job takes and 2 for one it refuses, its lines whole when piped (no hard wrap at
    80 columns) and its labels printed as text (no markup eaten)."""
    # A folder name long enough that any line holding it passes 80 columns.
    deep = tmp_path / ("a-rather-long-folder-name-for-the-dataset-" * 3)
    deep.mkdir()
    doc = _doc()
    doc["categories"][1]["name"] = "[bold]sign"  # rich markup, if not escaped
    ann, images = _files(deep, doc)

    empty = deep / "empty.json"
    empty.write_text(json.dumps({k: v for k, v in doc.items() if k != "annotations"}))
    run = _cli("from-coco", str(empty), str(images), str(deep / "train.jsonl"))
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1 and "has no annotations" in run.stderr
    run = _cli("from-coco", str(empty), str(images), str(deep / "train.jsonl"), "--allow-no-annotations")
    assert run.returncode == 0, run.stderr

    folder = deep / "folder.jsonl"
    folder.mkdir()
    run = _cli("from-coco", str(ann), str(images), str(folder))
    assert run.returncode == 2 and len(run.stderr.strip().splitlines()) == 1, run.stderr
    assert "is a folder" in run.stderr and not (deep / "folder.jsonl.tmp").exists()

    out = deep / "train.jsonl.gz"
    run = _cli("from-coco", str(ann), str(images), str(out))
    assert run.returncode == 0, run.stderr
    run = _cli("check", str(out))
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert f"{out}: 2 records with 3 objects (1 polygon, 2 boxes); 0 records without objects" in lines
    assert "  2 person" in lines and "  1 [bold]sign" in lines
    assert f"images: 2 distinct (2 references) under {deep}: 2 found, 0 missing, 0 unusable" in lines
    assert lines[-1] == "a job would accept this file"

    (images / "b.png").unlink()
    run = _cli("check", str(out), "--images", str(deep))
    assert run.returncode == 2
    lines = run.stdout.splitlines()
    assert f"  missing: {images / 'b.png'}" in lines
    assert "a job would refuse this file: 1 problem" in lines
    assert any(line.startswith("  - record '2', image 'images/b.png': file ") for line in lines), lines

    bad = deep / "bad.jsonl"
    bad.write_text('{"id": "1", "width": 4}\n')
    run = _cli("check", str(bad))
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1 and "bad.jsonl:1:" in run.stderr
