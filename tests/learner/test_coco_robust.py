"""`rmsft data from-coco` and `rmsft data check` on any input (issue 64): the inputs that gave a traceback (a huge
JSON integer, deeply nested JSON, a file name over 255 bytes, a folder) are one-line refusals naming file and
field, the wrong kind of file is named with the command for it, and a property test feeds both commands mutated
copies of files in the formats real tools write (tests/learner/coco_fixtures/: cocoapi's instances_val2017
layout, annolid's keypoint fixtures, labelme2coco's output; written for these tests, in those layouts) and
asserts exit 0 or 2 with one line of error, never a traceback. No model, no vLLM; in-process (typer's runner)."""

from __future__ import annotations

import copy
import json
import random
import re
import shutil
import traceback
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image
from typer.testing import CliRunner

from learner.data import coco
from learner.data.check import check_records
from learner.data.coco import CocoError, convert_coco
from learner.data.records import DataError, load_records
from rmsft_cli.app import app

FIXTURES = Path(__file__).resolve().parent / "coco_fixtures"
REAL = sorted(FIXTURES.glob("*.json"))
LONG = "a" * 300  # one path part over the 255 bytes a file name may have
DEEP = "[" * 100_000 + "]" * 100_000


def _images(doc: dict[str, Any], folder: Path) -> None:
    """The fixture's images as PNGs of the sizes it names (whatever the suffix: Pillow reads the content)."""
    for image in doc["images"]:
        path = folder / image["file_name"]
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (int(image["width"]), int(image["height"])), (40, 90, 160)).save(path, format="PNG")


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[dict[str, Any], Path]]:
    """Each fixture's document and an images folder holding its images."""
    out = {}
    for path in REAL:
        doc = json.loads(path.read_text())
        folder = tmp_path_factory.mktemp(path.stem)
        _images(doc, folder)
        out[path.name] = doc, folder
    return out


def _run(*args: str) -> tuple[int, str, BaseException | None]:
    res = CliRunner().invoke(app, list(args))
    return res.exit_code, res.stdout + res.stderr, res.exception


def _one_line_or_report(code: int, output: str, exc: BaseException | None, what: str) -> None:
    """Exit 0 or 2, no traceback; an error is one `error:` line (from-coco's "no image could be converted" adds
    its summary below it)."""
    if exc is not None and not isinstance(exc, SystemExit):
        pytest.fail(
            f"{what}: {type(exc).__name__} escaped:\n"
            + "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        )
    assert code in (0, 2), (what, code, output)
    assert "Traceback" not in output, (what, output)
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(errors) <= 1, (what, output)
    if code == 2:
        assert errors or "a job would refuse this file" in output, (what, output)


# the real files convert, and their output passes the check ----------------------------------------------------


@pytest.mark.parametrize("name", [p.name for p in REAL])
def test_the_real_format_files_convert_and_check(real: dict, name: str, tmp_path: Path) -> None:
    doc, folder = real[name]
    out = tmp_path / "train.jsonl"
    summary = convert_coco(FIXTURES / name, folder, out)
    assert summary.records == len(doc["images"]) and summary.objects > 0
    assert check_records(out).accepted


# the tracebacks the issue found -------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["width", "height", "bbox", "polygon"])
def test_a_huge_json_integer_is_a_refusal_or_a_skip_not_an_overflow(real: dict, where: str, tmp_path: Path) -> None:
    doc, folder = real["instances_val2017_sample.json"]
    doc = copy.deepcopy(doc)
    huge = "1" + "0" * 400
    if where in ("width", "height"):
        doc["images"][0][where] = "HUGE"
    elif where == "bbox":
        doc["annotations"][0]["bbox"][2] = "HUGE"
    else:
        doc["annotations"][0]["segmentation"][0][3] = "HUGE"
    path = tmp_path / "instances.json"
    path.write_text(json.dumps(doc).replace('"HUGE"', huge))
    out = tmp_path / "train.jsonl"
    if where in ("width", "height"):
        with pytest.raises(
            CocoError,
            match=rf"images\[0\] \(id 139, 000000000139.jpg\): {where} 1000.* is not a "
            "pixel size",
        ):
            convert_coco(path, folder, out)
        return
    summary = convert_coco(path, folder, out)
    if where == "bbox":  # the annotation is skipped, as any bbox that is not 4 finite numbers
        assert summary.skipped_annotations["bbox missing or not 4 finite numbers"] == 1
    else:  # a polygon that is not numbers: its bbox is written instead, and said
        assert summary.as_box["polygon of fewer than 3 points or no area, written as its box"] == 1
    code, output, exc = _run("data", "from-coco", str(path), str(folder), str(out))
    _one_line_or_report(code, output, exc, where)
    assert code == 0


def test_deeply_nested_json_is_a_refusal_for_both_commands(tmp_path: Path) -> None:
    coco, records = tmp_path / "deep.json", tmp_path / "deep.jsonl"
    coco.write_text(DEEP)
    records.write_text(DEEP + "\n")
    with pytest.raises(CocoError, match="deep.json: not a COCO file: JSON nested deeper than a parser follows"):
        convert_coco(coco, tmp_path, tmp_path / "out.jsonl")
    with pytest.raises(DataError, match=r"deep.jsonl:1: not a record: JSON nested deeper"):
        load_records(records)
    for args in (("from-coco", str(coco), str(tmp_path), str(tmp_path / "o.jsonl")), ("check", str(records))):
        code, output, exc = _run("data", *args)
        _one_line_or_report(code, output, exc, args[0])
        assert code == 2 and "nested deeper" in output


def test_long_file_names_and_folders_are_one_line_naming_the_path(real: dict, tmp_path: Path) -> None:
    _, folder = real["instances_val2017_sample.json"]
    ann = str(FIXTURES / "instances_val2017_sample.json")
    cases = {
        ("check", f"{LONG}.jsonl"): "cannot be read (File name too long)",
        ("from-coco", f"{LONG}.json", str(folder), "o.jsonl"): "cannot be read (File name too long)",
        ("from-coco", ann, str(folder), f"{LONG}.jsonl"): "file name too long (a name over 255 bytes",
        ("from-coco", ann, f"{LONG}", f"{LONG}/o.jsonl"): "file name too long (a name over 255 bytes",
        ("check", str(folder)): "is a folder: give the records file in it (.jsonl or .jsonl.gz)",
        ("from-coco", str(folder), str(folder), "o.jsonl"): "is a folder; ANNOTATIONS is the COCO instances file",
    }
    for args, said in cases.items():
        code, output, exc = _run("data", *args)
        _one_line_or_report(code, output, exc, args[0])
        assert code == 2 and said in output and "[Errno" not in output, (args, output)
        assert LONG[:40] in output or str(folder) in output  # the path is named


# the wrong kind of file -----------------------------------------------------------------------------------------


def test_a_wrong_file_is_named_with_the_command_for_it(real: dict, tmp_path: Path) -> None:
    doc, folder = real["instances_val2017_sample.json"]
    records = tmp_path / "train.jsonl"
    convert_coco(FIXTURES / "instances_val2017_sample.json", folder, records)
    one_line = tmp_path / "one.jsonl"
    one_line.write_text(records.read_text().splitlines()[0] + "\n")
    results = tmp_path / "instances_val2017_fakebbox_results.json"  # what cocoapi's results/ files hold
    results.write_text(json.dumps([{"image_id": 139, "category_id": 1, "bbox": [9.9, 3.1, 5.0, 11.5], "score": 0.236}]))
    flat = tmp_path / "flat.json"  # the instances file on one line
    flat.write_text(json.dumps(doc))
    cases = [
        (
            ("check", str(FIXTURES / "instances_val2017_sample.json")),
            "this is a COCO instances file (images, annotations, categories), not a training records file",
            "`rmsft data from-coco FILE IMAGES_DIR OUT.jsonl`",
        ),
        (("check", str(flat)), "this is a COCO instances file", "rmsft data from-coco"),
        (("check", str(results)), "this is a COCO results file", "from the split's instances file"),
        (
            ("from-coco", str(records), str(folder), str(tmp_path / "o.jsonl")),
            "this is a training records file (JSONL, one record per line), not a COCO instances file",
            "`rmsft data check FILE`",
        ),
        (
            ("from-coco", str(one_line), str(folder), str(tmp_path / "o.jsonl")),
            "this is a training records file",
            "rmsft data check",
        ),
        (
            ("from-coco", str(results), str(folder), str(tmp_path / "o.jsonl")),
            "this is a COCO results file",
            "instances_*.json",
        ),
    ]
    for args, kind, command in cases:
        code, output, exc = _run("data", *args)
        _one_line_or_report(code, output, exc, args[0])
        text = " ".join(output.split())
        assert code == 2 and kind in text and command in text and "not valid JSON" not in text, (args, text)


# the property test: mutated real files ----------------------------------------------------------------------------

NASTY: list[Any] = [
    None,
    True,
    False,
    0,
    -1,
    1.5,
    -1e308,
    10**400,
    "",
    "polygon",
    "1",
    "\n",
    [],
    {},
    [[]],
    [1, 2],
    [[1, 2, 3]],
    {"counts": "x", "size": [1]},
    "x" * 10_000,
    "a\u200bb",
    "\x00",
    "DEEP",
    [0, 0, 0, 0],
    [1e308, 1e308, 1e308, 1e308],
    [-5, -5, 2, 2],
    [100, 100, 50, 50],
]


def _paths(node: Any, at: tuple = ()) -> list[tuple]:
    out = [at]
    if isinstance(node, dict):
        for k, v in node.items():
            out.extend(_paths(v, (*at, k)))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out.extend(_paths(v, (*at, i)))
    return out


def _mutate(doc: Any, rng: random.Random, n: int) -> Any:
    """`n` random edits of the document tree: a node replaced by a nasty value, a key deleted, an entry
    duplicated (duplicate ids), a list emptied."""
    doc = copy.deepcopy(doc)
    for _ in range(n):
        path = rng.choice(_paths(doc))
        if not path:
            continue
        parent = doc
        for key in path[:-1]:
            parent = parent[key]
        key, op = path[-1], rng.randrange(4)
        if op == 0 or not isinstance(parent, dict | list):
            parent[key] = copy.deepcopy(rng.choice(NASTY))
        elif op == 1 and isinstance(parent, dict):
            del parent[key]
        elif op == 2 and isinstance(parent, list):
            parent.append(copy.deepcopy(parent[key]))
        else:
            parent[key] = copy.deepcopy(rng.choice(NASTY))
    return doc


def _text(doc: Any) -> str:
    # 10**400 and the deep nesting go in as text: json.dumps writes big ints whole, and would recurse on DEEP
    return json.dumps(doc).replace('"DEEP"', "[" * 5000 + "]" * 5000)


@settings(
    max_examples=120,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    which=st.integers(0, len(REAL) - 1),
    seed=st.integers(0, 2**32 - 1),
    edits=st.integers(1, 6),
    cut=st.one_of(st.none(), st.floats(0.0, 1.0)),
)
def test_mutated_real_files_exit_0_or_2_with_one_line(
    real: dict, tmp_path_factory: pytest.TempPathFactory, which: int, seed: int, edits: int, cut: float | None
) -> None:
    name = REAL[which].name
    doc, folder = real[name]
    rng = random.Random(seed)
    work = tmp_path_factory.mktemp("mutated")
    text = _text(_mutate(doc, rng, edits))
    if cut is not None:  # a file cut short, as a download that stopped
        text = text[: int(len(text) * cut)]
    ann = work / name
    ann.write_text(text)
    out = work / "train.jsonl"
    code, output, exc = _run("data", "from-coco", str(ann), str(folder), str(out))
    _one_line_or_report(code, output, exc, f"from-coco {name} seed {seed}")
    # data check on the mutated COCO file itself (the wrong kind), and on mutated records
    code, output, exc = _run("data", "check", str(ann), "--images", str(folder))
    _one_line_or_report(code, output, exc, f"check {name} seed {seed}")
    if out.exists():
        lines = out.read_text().splitlines()
        records = [_text(_mutate(json.loads(line), rng, edits)) if rng.random() < 0.5 else line for line in lines]
        out.write_text("\n".join(records) + "\n")
        code, output, exc = _run("data", "check", str(out))
        _one_line_or_report(code, output, exc, f"check records of {name} seed {seed}")
    shutil.rmtree(work)


# the silent accepts, each refused or reported with its line ----------------------------------------------------


def _sample(real: dict) -> tuple[dict[str, Any], Path]:
    doc, folder = real["instances_val2017_sample.json"]
    return copy.deepcopy(doc), folder


def _convert(doc: dict[str, Any], folder: Path, tmp_path: Path):
    path = tmp_path / "instances.json"
    path.write_text(json.dumps(doc))
    out = tmp_path / "train.jsonl"
    summary = convert_coco(path, folder, out)
    return summary, [json.loads(line) for line in out.read_text().splitlines()]


def test_a_polygon_with_a_garbage_bbox_is_skipped_as_docs_data_md_says(real: dict, tmp_path: Path) -> None:
    doc, folder = _sample(real)
    doc["annotations"][0]["bbox"] = ["x", 1, 2, 3]  # its polygon is fine
    summary, records = _convert(doc, folder, tmp_path)
    assert summary.skipped_annotations == {coco.SKIP_BAD_BOX: 1, coco.SKIP_CROWD: 1}
    assert summary.examples[coco.SKIP_BAD_BOX] == "annotation id 1"
    assert [o["desc"] for o in records[0]["objects"]] == ["potted plant"]  # annotation 1's person is not written


def test_a_negative_width_is_named_as_such(real: dict, tmp_path: Path) -> None:
    doc, folder = _sample(real)
    doc["annotations"][0]["bbox"] = [9.98, 3.12, -5.03, 11.54]
    summary, _ = _convert(doc, folder, tmp_path)
    assert summary.skipped_annotations[coco.SKIP_NEGATIVE_BOX] == 1
    assert coco.SKIP_NEGATIVE_BOX == "bbox with a negative width or height"
    assert coco.SKIP_BAD_BOX not in summary.skipped_annotations


@pytest.mark.parametrize("key", ["image_id", "category_id"])
def test_true_as_an_id_is_not_read_as_id_1(real: dict, tmp_path: Path, key: str) -> None:
    doc, folder = _sample(real)
    doc["images"][0]["id"] = 1  # an image 1 and a category 1 for `true` to land on
    for ann in doc["annotations"]:
        if ann["image_id"] == 139:
            ann["image_id"] = 1
    doc["annotations"][3][key] = True  # annotation 3 (a bear on image 285)
    summary, records = _convert(doc, folder, tmp_path)
    assert summary.skipped_annotations[coco.SKIP_BAD_ID] == 1
    assert summary.examples[coco.SKIP_BAD_ID].startswith("annotation id 3, image_id ")
    assert "bear" not in {o["desc"] for r in records for o in r["objects"]}


@pytest.mark.parametrize(
    ("name", "said"),
    [
        ("traffic\nlight", "holds a line break (U+000A)"),
        ("traffic\x07light", "holds a control character (U+0007)"),
        ("traffic\u200blight", "holds zero width space (U+200B)"),
        ("x" * 10_000, "10000 characters long (at most 200)"),
    ],
)
def test_category_names_no_answer_should_carry_are_skipped_with_the_reason(
    real: dict, tmp_path: Path, name: str, said: str
) -> None:
    doc, folder = _sample(real)
    doc["categories"][1]["name"] = name  # bear, annotation 3's
    summary, records = _convert(doc, folder, tmp_path)
    assert summary.skipped_annotations[coco.SKIP_BAD_CATEGORY] == 1
    example = summary.examples[coco.SKIP_BAD_CATEGORY]
    assert example.startswith("annotation id 3, category_id 23: ") and said in example and len(example) < 200
    assert all(o["desc"] != name for r in records for o in r["objects"])


def test_a_segmentation_that_is_no_polygon_list_is_said(real: dict, tmp_path: Path) -> None:
    doc, folder = _sample(real)
    doc["annotations"][0]["segmentation"] = "polygon"
    doc["annotations"][3]["segmentation"] = [3.5, 20.25, 28.75, 20.0, 29.0, 31.5]  # flat, not a list of polygons
    summary, _ = _convert(doc, folder, tmp_path)
    assert summary.as_box[coco.AS_BOX_BAD_SEGMENTATION] == 2
    # the flat list is not "a polygon in several parts": that stays the fixture's own annotation 2 alone
    assert summary.as_box[coco.AS_BOX_MULTI] == 1 and summary.examples[coco.AS_BOX_MULTI] == "annotation id 2"


def test_duplicate_annotation_ids_are_a_warning_line(real: dict, tmp_path: Path) -> None:
    doc, folder = _sample(real)
    doc["annotations"][1]["id"] = doc["annotations"][0]["id"]
    summary, records = _convert(doc, folder, tmp_path)
    assert summary.duplicate_ids == 1 and sum(len(r["objects"]) for r in records) == 3  # each still converted
    assert (
        "warning: 1 annotation id used more than once (first: id 1): every annotation is converted, but a tool "
        "that looks annotations up by id (COCO's evaluation) cannot tell them apart"
    ) in summary.lines()


def test_data_check_warns_of_boxes_outside_the_image_and_of_a_file_without_objects(tmp_path: Path) -> None:
    Image.new("RGB", (32, 24)).save(tmp_path / "a.png")
    base = {"width": 32, "height": 24, "messages": [{"role": "user", "content": "Detect."}], "images": ["a.png"]}
    outside = tmp_path / "outside.jsonl"
    outside.write_text(
        "".join(
            json.dumps({**base, "id": str(i), "objects": objs}) + "\n"
            for i, objs in enumerate(
                [
                    [{"desc": "a", "bbox_2d": [1, 1, 40, 20]}, {"desc": "b", "bbox_2d": [1, 1, 5, 5]}],
                    [{"desc": "a", "poly": [-3, 0, 10, 0, 10, 10]}],
                    [{"desc": "a", "bbox_2d": [0, 0, 32, 24]}],  # the whole image: inside
                ]
            )
        )
    )
    check = check_records(outside)
    assert check.accepted
    assert check.warnings == [
        "2 of 4 objects (in 2 records) reach outside their image's width x height: training "
        "clamps them to its edges (first: record '0' object 1 bbox_2d [1.0, 1.0, 40.0, 20.0] "
        "in 32x24)"
    ]
    empty = tmp_path / "empty.jsonl"
    empty.write_text("".join(json.dumps({**base, "id": str(i)}) + "\n" for i in range(3)))
    check = check_records(empty)
    assert check.warnings == [
        "all 3 records are without objects: a detection job would teach the model that the images hold nothing"
    ]
    code, output, exc = _run("data", "check", str(empty))
    _one_line_or_report(code, output, exc, "check")
    assert code == 0 and "warning: all 3 records are without objects" in output
    assert "a job would accept this file (1 warning above)" in output


def test_an_unknown_key_in_a_record_names_the_nearest(tmp_path: Path) -> None:
    base = {"id": "a", "width": 4, "height": 4, "messages": [{"role": "user", "content": "x"}]}
    for extra, said in (
        ({"objects": [{"desc": "a", "bbox": [1, 1, 2, 2]}]}, "objects.0.bbox: unknown key (did you mean bbox_2d?)"),
        ({"messages": [{"role": "user", "contnet": "x"}]}, "messages.0.contnet: unknown key (did you mean content?)"),
        ({"zzz": 1}, "zzz: unknown key (a Record has id, width, height, messages, images, objects,"),
    ):
        path = tmp_path / "r.jsonl"
        path.write_text(json.dumps({**base, **extra}) + "\n")
        with pytest.raises(DataError, match=re.escape(said)):
            load_records(path)
