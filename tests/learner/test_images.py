"""learner/data/images.py: every reference form resolves, every broken image fails at load with a message
that names the record and the reference, and a record's images are read from disk once."""

from __future__ import annotations

import base64
import io
import json
import random
import re
import struct
import warnings
import zlib
from pathlib import Path

import pytest
from PIL import Image, ImageFile

import learner.data.images as images_mod
from learner.data.dataset import load_dataset
from learner.data.images import ImageError, ImageStore, LoadedImage
from learner.data.records import DataError, Record, load_records

BIG = 50_000_000


def _png_bytes(size: tuple[int, int], colour: tuple[int, int, int] = (200, 20, 20)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, format="PNG")
    return buf.getvalue()


def _noise(size: tuple[int, int], fmt: str) -> bytes:
    """An image whose pixel data does not compress away, so cutting the file cuts pixels."""
    buf = io.BytesIO()
    Image.frombytes("RGB", size, random.Random(0).randbytes(size[0] * size[1] * 3)).save(buf, format=fmt)
    return buf.getvalue()


def _cut(data: bytes, keep: float) -> bytes:
    return data[: int(len(data) * keep)]


def _write_png(path: Path, size: tuple[int, int], colour: tuple[int, int, int] = (200, 20, 20)) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(_png_bytes(size, colour))
    return path


def _png_claiming(width: int, height: int) -> bytes:
    """A well-formed PNG (valid CRCs) whose header claims `width` x `height`, with almost no pixel
    data: decoding it would fail or take forever, reading its header costs nothing."""

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def _record(rid: str, images: list[str], size: tuple[int, int] = (12, 8)) -> Record:
    return Record.model_validate(
        {
            "id": rid,
            "width": size[0],
            "height": size[1],
            "messages": [{"role": "user", "content": "Detect."}],
            "images": images,
        }
    )


def _store(tmp_path: Path, max_image_pixels: int = BIG, image_root: Path | None = None, cache: int = 256) -> ImageStore:
    return ImageStore(image_root, tmp_path / "data.jsonl", max_image_pixels, cache_images=cache)


# ---------------------------------------------------------------- reference forms


def test_every_reference_form_loads(tmp_path: Path) -> None:
    rel = _write_png(tmp_path / "imgs" / "rel.png", (12, 8), (10, 200, 10))
    spaced = _write_png(tmp_path / "my imgs" / "a b.png", (12, 8), (10, 10, 200))
    inline = _png_bytes((12, 8), (200, 200, 10))
    refs = {
        "imgs/rel.png": (rel.read_bytes(), (10, 200, 10)),
        str(rel): (rel.read_bytes(), (10, 200, 10)),
        spaced.as_uri(): (spaced.read_bytes(), (10, 10, 200)),  # file:///.../my%20imgs/a%20b.png
        "file://localhost" + str(spaced): (spaced.read_bytes(), (10, 10, 200)),
        "data:image/png;base64," + base64.b64encode(inline).decode(): (inline, (200, 200, 10)),
    }
    assert "%20" in spaced.as_uri()
    store = _store(tmp_path)
    records = [_record(f"r{i}", [ref]) for i, ref in enumerate(refs)]
    store.validate(records)
    for record, (ref, (data, colour)) in zip(records, refs.items(), strict=True):
        (loaded,) = store.load(record)
        assert loaded.ref == ref
        assert loaded.data == data, ref  # the bytes as stored: what goes over gRPC
        assert (loaded.width, loaded.height) == (12, 8)
        pic = loaded.pil()
        assert pic.mode == "RGB" and pic.size == (12, 8)
        assert pic.getpixel((5, 4)) == colour


def test_relative_paths_use_image_root_when_set_else_the_dataset_folder(tmp_path: Path) -> None:
    _write_png(tmp_path / "same.png", (12, 8), (255, 0, 0))  # next to data.jsonl
    _write_png(tmp_path / "root" / "same.png", (12, 8), (0, 0, 255))
    record = _record("r", ["same.png"])
    by_dataset = _store(tmp_path).load(record)[0]
    by_root = _store(tmp_path, image_root=tmp_path / "root").load(record)[0]
    assert by_dataset.pil().getpixel((0, 0)) == (255, 0, 0)
    assert by_root.pil().getpixel((0, 0)) == (0, 0, 255)


def test_load_dataset_validates_images_and_keeps_text_datasets_working(tmp_path: Path) -> None:
    _write_png(tmp_path / "a.png", (12, 8))
    good = tmp_path / "good.jsonl"
    good.write_text(_record("a", ["a.png"]).model_dump_json() + "\n")
    records, store = load_dataset(good, None, BIG)
    assert [r.id for r in records] == ["a"]
    assert store.load(records[0])[0].width == 12

    bad = tmp_path / "bad.jsonl"
    bad.write_text(_record("b", ["missing.png"]).model_dump_json() + "\n")
    assert load_records(bad)[0].images == ["missing.png"]  # the records-only API does not look at images
    with pytest.raises(DataError, match=r"record 'b', image 'missing.png': file .*missing.png does not exist"):
        load_dataset(bad, None, BIG)

    text = tmp_path / "text.jsonl"
    text.write_text(
        json.dumps({"id": "t", "width": 5, "height": 5, "messages": [{"role": "user", "content": "hi"}]}) + "\n"
    )
    records, store = load_dataset(text, None, 1)  # no image to check, whatever the limit
    assert store.load(records[0]) == []


# ---------------------------------------------------------------- problems, one at a time


def _flipped_png(path: Path) -> None:
    data = bytearray(_noise((12, 8), "PNG"))
    data[data.find(b"IDAT") + 6] ^= 0xFF  # inside the compressed pixels: the chunk's CRC no longer matches
    path.write_bytes(bytes(data))


CASES = {
    "missing": (lambda d: None, "nope.png", r"file .*nope\.png does not exist"),
    "folder": (lambda d: (d / "sub.png").mkdir(), "sub.png", r"is a folder, not an image file"),
    "truncated-png": (
        lambda d: (d / "t.png").write_bytes(_cut(_noise((12, 8), "PNG"), 0.8)),
        "t.png",
        r"is corrupt or truncated \(PNG",
    ),
    "png-cut-in-header": (
        lambda d: (d / "h.png").write_bytes(_png_bytes((12, 8))[:30]),
        "h.png",
        r"starts like a PNG file but its header is corrupt or truncated",
    ),
    "bit-flipped-png": (lambda d: _flipped_png(d / "f.png"), "f.png", r"corrupt or truncated \(PNG: .*checksum"),
    "truncated-jpeg": (
        lambda d: (d / "t.jpg").write_bytes(_cut(_noise((12, 8), "JPEG"), 0.9)),
        "t.jpg",
        r"is corrupt or truncated \(JPEG: .*truncated",
    ),
    "not-an-image": (lambda d: (d / "x.png").write_text("hello, I am text"), "x.png", r"is not an image PIL can read"),
    "empty-file": (lambda d: (d / "e.png").write_bytes(b""), "e.png", r"is not an image PIL can read"),
    "http": (
        lambda d: None,
        "http://example.com/a.png",
        r"http:// images are not fetched; only local files .* and data:image/...;base64 URIs are supported",
    ),
    "s3": (lambda d: None, "s3://bucket/a.png", r"s3:// images are not fetched; only local files"),
    "remote-file-host": (lambda d: None, "file://server/a.png", r"file URI names host 'server'; only local files"),
    "relative-file-uri": (lambda d: None, "file:a.png", r"a file URI needs an absolute path"),
    "data-uri-not-base64": (lambda d: None, "data:image/png,abc", r"data URI is not base64-encoded"),
    "data-uri-bad-base64": (lambda d: None, "data:image/png;base64,@@@@", r"data URI payload is not valid base64"),
    "data-uri-not-image": (lambda d: None, "data:text/plain;base64,aGk=", r"data URI has media type 'text/plain'"),
    "data-uri-garbage": (lambda d: None, "data:image/png;base64,aGVsbG8=", r"is not an image PIL can read"),
    "empty-ref": (lambda d: None, " ", r"empty image reference"),
    "too-large": (
        lambda d: _write_png(d / "big.png", (12, 8)),
        "big.png",
        r"is 12x8 = 96 pixels, more than spec.model.vision.maxImagePixels \(95\)",
    ),
    "size-mismatch": (
        lambda d: _write_png(d / "m.png", (10, 8)),
        "m.png",
        r"image is 10x8 but the record says width=12, height=8 \(ground truth is in the record's",
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_each_problem_is_refused_at_validation_naming_record_and_reference(tmp_path: Path, case: str) -> None:
    make, ref, expected = CASES[case]
    make(tmp_path)
    record = _record("rec-7", [ref])
    with pytest.raises(ImageError) as err:
        _store(tmp_path, max_image_pixels=95 if case == "too-large" else BIG).validate([record])
    message = str(err.value)
    assert f"record 'rec-7', image {ref!r}: " in message
    assert len(err.value.problems) == 1
    assert re.search(expected, message), message
    assert "Traceback" not in message
    # The same problem from load() (e.g. a file that vanished or changed after validation), except
    # those only validation looks for (integrity is checked once, at load; decode errors come from pil()).
    if case in {"truncated-png", "bit-flipped-png", "truncated-jpeg"}:
        with pytest.raises(ImageError, match=r"record 'rec-7', .*cannot be decoded"):
            for loaded in _store(tmp_path).load(record):
                loaded.pil()
        return
    with pytest.raises(ImageError) as err:
        _store(tmp_path, max_image_pixels=95 if case == "too-large" else BIG).load(record)
    assert f"record 'rec-7', image {ref!r}: " in str(err.value)
    assert re.search(expected, str(err.value)), str(err.value)


def test_data_uris_are_shortened_in_messages(tmp_path: Path) -> None:
    payload = base64.b64encode(b"not an image at all " * 500).decode()
    ref = "data:image/png;base64," + payload
    with pytest.raises(ImageError) as err:
        _store(tmp_path).validate([_record("r", [ref])])
    message = str(err.value)
    assert payload not in message and len(message) < 400
    assert f"...({len(ref)} chars)" in message and "record 'r'" in message


def test_valid_jpegs_pass_with_and_without_a_clean_end(tmp_path: Path) -> None:
    buf = io.BytesIO()
    Image.new("RGB", (12, 8), (30, 60, 90)).save(buf, format="JPEG")
    (tmp_path / "ok.jpg").write_bytes(buf.getvalue())
    (tmp_path / "tail.jpg").write_bytes(buf.getvalue() + b"camera trailer")  # decoded to be sure, then accepted
    _store(tmp_path).validate([_record("a", ["ok.jpg"]), _record("b", ["tail.jpg"])])


def test_multi_image_records_skip_the_size_check_but_not_the_others(tmp_path: Path) -> None:
    _write_png(tmp_path / "a.png", (12, 8))
    _write_png(tmp_path / "b.png", (30, 30))
    _store(tmp_path).validate([_record("two", ["a.png", "b.png"], size=(100, 100))])
    with pytest.raises(ImageError, match=r"record 'two', image 'c.png': file .* does not exist"):
        _store(tmp_path).validate([_record("two", ["a.png", "c.png"], size=(100, 100))])


# ---------------------------------------------------------------- size limit from the header


def test_a_huge_claimed_size_is_refused_from_the_header_without_decoding(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_decoding(self: ImageFile.ImageFile) -> None:
        raise AssertionError("pixel data was decoded")

    monkeypatch.setattr(ImageFile.ImageFile, "load", no_decoding)
    claims = {
        "medium.png": (5000, 5000),  # under PIL's own bomb limit: our header check refuses it
        "warned.png": (10000, 10000),  # between PIL's limit and twice it: PIL would only warn
        "bomb.png": (100000, 100000),  # past twice PIL's limit: PIL raises, we still give our message
    }
    for name, (w, h) in claims.items():
        (tmp_path / name).write_bytes(_png_claiming(w, h))
    records = [_record(name, [name], size=claims[name]) for name in claims]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no DecompressionBombWarning may leak
        with pytest.raises(ImageError) as err:
            _store(tmp_path, max_image_pixels=20_000_000).validate(records)
    problems = err.value.problems
    assert len(problems) == 3
    assert "is 5000x5000 = 25000000 pixels, more than spec.model.vision.maxImagePixels (20000000)" in problems[0]
    assert "is 10000x10000 = 100000000 pixels, more than" in problems[1]
    assert "is 10000000000 pixels, more than spec.model.vision.maxImagePixels (20000000)" in problems[2]
    assert all("decompression bomb" not in p for p in problems)


def test_a_limit_above_pils_own_is_honoured(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", Image.MAX_IMAGE_PIXELS)  # restored after the test
    assert Image.MAX_IMAGE_PIXELS is not None
    w, h = 15000, 14000  # 210 Mpx: more than twice PIL's default limit, which would raise
    assert w * h > 2 * Image.MAX_IMAGE_PIXELS
    (tmp_path / "wide.png").write_bytes(_png_claiming(w, h))
    _store(tmp_path, max_image_pixels=300_000_000).validate([_record("wide", ["wide.png"], size=(w, h))])
    assert Image.MAX_IMAGE_PIXELS == 300_000_000


# ---------------------------------------------------------------- all problems at once


def test_many_problems_become_one_error_listing_them(tmp_path: Path) -> None:
    _write_png(tmp_path / "ok.png", (12, 8))
    _write_png(tmp_path / "wrong.png", (9, 9))
    records = [_record("fine", ["ok.png"]), _record("mismatch", ["wrong.png"]), _record("web", ["https://x/y.png"])]
    records += [_record(f"gone-{i}", [f"gone-{i}.png"]) for i in range(13)]
    with pytest.raises(ImageError) as err:
        _store(tmp_path).validate(records)
    message = str(err.value)
    assert message.startswith(f"dataset {tmp_path / 'data.jsonl'}: 15 image problems:\n")
    assert "record 'mismatch'" in message and "record 'web'" in message and "record 'gone-7'" in message
    assert "record 'gone-8'" not in message  # the 11th problem onwards is counted, not listed
    assert message.endswith("\n  ... and 5 more")
    assert message.count("\n  - ") == 10
    assert len(err.value.problems) == 15 and "record 'gone-12'" in err.value.problems[-1]
    assert "record 'fine'" not in message


def test_validation_reads_a_shared_image_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _write_png(tmp_path / "shared.png", (12, 8))
    opened: list[object] = []
    real_open = images_mod.Image.open
    monkeypatch.setattr(images_mod.Image, "open", lambda fp, *a, **k: opened.append(fp) or real_open(fp, *a, **k))
    _store(tmp_path).validate([_record(f"r{i}", ["shared.png"]) for i in range(50)])
    assert len(opened) == 1  # PNG: one header read, verified once for the 50 records


# ---------------------------------------------------------------- the cache


def test_the_cache_reads_each_file_once_while_it_is_in_use(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a = _write_png(tmp_path / "a.png", (12, 8))
    _write_png(tmp_path / "b.png", (12, 8), (0, 0, 255))
    reads: list[Path] = []
    real = images_mod._read_file
    monkeypatch.setattr(images_mod, "_read_file", lambda p: reads.append(p) or real(p))
    store = _store(tmp_path, cache=1)
    ra, ra2, rb = _record("a", ["a.png"]), _record("a-again", [str(a)]), _record("b", ["b.png"])

    first = store.load(ra)[0]
    assert store.load(ra)[0].data == first.data
    assert store.load(ra2)[0].data == first.data  # same file by another reference form: one cache entry
    assert reads == [a]
    a.unlink()  # gone from disk, still served from the cache
    assert store.load(ra)[0].pil().getpixel((0, 0)) == (200, 20, 20)
    assert len(reads) == 1

    store.load(rb)  # evicts a.png (cache of 1)
    assert len(reads) == 2
    with pytest.raises(ImageError, match=r"record 'a', image 'a.png': file .*a.png does not exist \(it was there"):
        store.load(ra)


def test_a_zero_size_cache_reads_every_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _write_png(tmp_path / "a.png", (12, 8))
    reads: list[Path] = []
    real = images_mod._read_file
    monkeypatch.setattr(images_mod, "_read_file", lambda p: reads.append(p) or real(p))
    store = _store(tmp_path, cache=0)
    for _ in range(3):
        store.load(_record("a", ["a.png"]))
    assert len(reads) == 3


def test_pil_of_undecodable_bytes_names_record_and_reference() -> None:
    bad = LoadedImage(ref="x.png", data=_cut(_noise((12, 8), "PNG"), 0.8), width=12, height=8, record_id="r-9")
    with pytest.raises(ImageError, match=r"record 'r-9', image 'x.png': cannot be decoded"):
        bad.pil()
    assert "bytes" in repr(bad) and "\\x89" not in repr(bad)
