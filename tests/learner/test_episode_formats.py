"""The E-step with each output format: `build_segments` binds a pixels format per record to the image size
the processor resized it to, and keeps its old behaviour (coordexp) for callers that pass no format."""

from __future__ import annotations

from pathlib import Path

import pytest

from learner.core.codec import COORDEXP, FormatError, QwenJsonFormat
from learner.core.match import MatchConfig
from learner.core.targets import IGNORE_INDEX
from learner.core.vocab import VocabView
from learner.data.episode import build_segments, ground_truth, predicted_detections
from learner.data.records import Record


def _record(rid: str, objects: list[dict], width: int = 640, height: int = 480) -> Record:
    return Record.model_validate(
        {
            "id": rid,
            "width": width,
            "height": height,
            "objects": objects,
            "messages": [{"role": "user", "content": "Detect."}],
        }
    )


@pytest.fixture(scope="module")
def stock_vocab() -> VocabView:
    from rmsft_dev.tiny_model import build_tokenizer

    return VocabView.from_hf_tokenizer(build_tokenizer(0, coord_tokens=False), coord_tokens=False)


def test_pixels_format_is_bound_per_record(stock_vocab: VocabView) -> None:
    vocab = stock_vocab
    # Originals 640x480 and 1280x960; the processor resized them to 320x240 and 640x480.
    recs = [
        _record("a", [{"desc": "cat", "bbox_2d": [64, 48, 320, 240]}]),
        _record("b", [{"desc": "dog", "poly": [0, 0, 1280, 0, 640, 960]}], 1280, 960),
    ]
    sizes = [(320, 240), (640, 480)]
    prompt = list(vocab.encode("Detect.")) + [vocab.eos_id]
    fmt = QwenJsonFormat(coordinates="pixels")
    # Record a answered right in its resized pixels; record b answered with nothing.
    responses = [
        list(vocab.encode('[{"bbox_2d": [32, 24, 160, 120], "label": "cat"}]')) + [vocab.eos_id],
        list(vocab.encode("[]")) + [vocab.eos_id],
    ]
    segs, stats = build_segments(
        recs, [prompt] * 2, [prompt] * 2, responses, vocab, MatchConfig(), fmt=fmt, image_sizes=sizes
    )
    assert (stats.matched, stats.false_negatives, stats.false_positives, stats.dropped) == (1, 1, 0, 0)
    texts = [vocab.decode_bytes(s.input_ids[len(prompt) : -1]).decode() for s in segs]
    assert texts[0] == '[{"bbox_2d": [32, 24, 160, 120], "label": "cat"}]'
    # The missed polygon is appended as its enclosing box, in record b's resized pixels.
    assert texts[1] == '[{"bbox_2d": [0, 0, 639, 480], "label": "dog"}]'
    assert all(s.coord_positions == () for s in segs)
    assert segs[1].labels[-1] == vocab.eos_id and segs[1].labels[len(prompt)] == IGNORE_INDEX  # `[` is its own
    # Bins are relative to the image: detections come back in the record's own pixels, no format needed.
    from learner.core.parse import parse

    parsed = parse(responses[0], vocab, fmt.for_image(*sizes[0]))
    assert predicted_detections(parsed, recs[0]) == [("cat", "bbox_2d", [64.0, 48.0, 320.0, 240.0])]
    assert ground_truth(recs[0], fmt) == [o.obj for o in parsed.objects]

    with pytest.raises(FormatError, match="record 'a'.*for_image"):
        build_segments(recs, [prompt] * 2, [prompt] * 2, responses, vocab, MatchConfig(), fmt=fmt)
    with pytest.raises(ValueError, match="1 image size"):
        build_segments(
            recs, [prompt] * 2, [prompt] * 2, responses, vocab, MatchConfig(), fmt=fmt, image_sizes=sizes[:1]
        )


def test_default_format_is_coordexp(tiny_tokenizer) -> None:
    vocab = VocabView.from_hf_tokenizer(tiny_tokenizer)
    rec = _record("a", [{"desc": "cat", "bbox_2d": [64, 48, 320, 240]}])
    prompt = list(vocab.encode("Detect.")) + [vocab.eos_id]
    old, _ = build_segments([rec], [prompt], [prompt], [[vocab.eos_id]], vocab, MatchConfig())
    new, _ = build_segments(
        [rec], [prompt], [prompt], [[vocab.eos_id]], vocab, MatchConfig(), fmt=COORDEXP, image_sizes=[(320, 240)]
    )  # coordexp ignores sizes
    assert old == new
    assert vocab.decode_bytes(old[0].input_ids[len(prompt) : -1]).decode() == COORDEXP.render(ground_truth(rec))
    assert len(old[0].coord_positions) == 4


def test_job_spec_format_reaches_the_core() -> None:
    from typing import get_args

    from learner.core.codec import COORDJSON, FORMAT_NAMES, QWEN_JSON, CoordExpFormat, output_format
    from learner.train.config import core_configs
    from rmsft.jobspec import FormatOptions, JobSpecError, TrainingConfig, parse_job

    assert set(get_args(TrainingConfig.model_fields["format"].annotation)) == set(FORMAT_NAMES)
    for name in FORMAT_NAMES:
        for coords in get_args(FormatOptions.model_fields["coordinates"].annotation):
            for polys in get_args(FormatOptions.model_fields["polygons"].annotation):
                assert output_format(name, coordinates=coords, polygons=polys).name == name
    assert core_configs(TrainingConfig(data={"path": "d.jsonl"})).fmt == COORDEXP
    cfg = TrainingConfig(data={"path": "d.jsonl"}, format="qwen_json", format_options={"coordinates": "pixels"})
    assert core_configs(cfg).fmt == QwenJsonFormat(coordinates="pixels")
    cfg = TrainingConfig(data={"path": "d.jsonl"}, format_options={"polygons": "flat"})
    assert core_configs(cfg).fmt == CoordExpFormat(polygons="flat")
    assert core_configs(TrainingConfig(data={"path": "d.jsonl"}, format="qwen_json")).fmt == QWEN_JSON
    assert core_configs(TrainingConfig(data={"path": "d.jsonl"}, format="coordjson")).fmt == COORDJSON
    for options in ({"polygons": "flat"}, {"coordinates": "pixels"}):  # coordjson has neither option
        with pytest.raises(ValueError, match="applies to format"):
            TrainingConfig(data={"path": "d.jsonl"}, format="coordjson", format_options=options)

    # A bad value is refused at load, naming the key.
    import yaml

    doc = yaml.safe_load((Path(__file__).resolve().parents[2] / "configs/local-tiny.yaml").read_text())
    doc["spec"]["training"]["format"] = "yolo"
    doc["spec"]["training"]["format_options"] = {"coordinates": "absolute"}
    with pytest.raises(JobSpecError) as err:
        parse_job(doc)
    assert "spec.training.format: Input should be 'coordexp', 'coordjson' or 'qwen_json'" in str(err.value)
    assert "spec.training.format_options.coordinates: Input should be 'relative' or 'pixels'" in str(err.value)
