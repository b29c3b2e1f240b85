"""Images of training records: resolve each reference, check them all at load, read each once.

A record's `images` entries may be (see also learner/data/records.py):

- a relative path, resolved against `spec.training.data.image_root`, or when that is unset against
  the folder of the dataset file;
- an absolute path, or a `file://` URI (`file:///data/a.jpg`, host empty or `localhost`);
- inline bytes as a data URI, `data:image/<fmt>;base64,<payload>`.

Nothing else is fetched (http://, s3://, ...): the learner reads images once per step and sends the
bytes to every rollout server, so a remote store would sit in the training loop's critical path.

`ImageStore.validate` runs at load and reads headers only (plus PIL's `verify`), so thousands of
records check in seconds while a missing, corrupt, oversized or wrongly sized image fails before any
GPU time is spent, all problems in one message. `ImageStore.load` then returns the file's bytes as-is
(what travels over gRPC) through an LRU cache, so a record's images are read from disk once while
they are in use (the same bytes go to the servers and to the learner's own processor).

Torch-free on purpose: only PIL.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import re
import threading
import warnings
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlsplit

from PIL import Image, UnidentifiedImageError

from learner.data.records import DataError

if TYPE_CHECKING:
    from learner.data.records import Record

MAX_LISTED_PROBLEMS = 10
_DATA_URI_SHOWN = 48  # characters of a data URI quoted in messages; the payload can be megabytes
_REMOTE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_DATA_URI = re.compile(r"^data:(?P<mime>[^;,]*)(?P<params>(?:;[^;,]*)*),(?P<payload>.*)$", re.DOTALL)
_BOMB_PIXELS = re.compile(r"\((\d+) pixels\)")


class ImageError(DataError):
    """An image reference that cannot be used; the message names the record id, the reference and
    the problem (several of them when raised by `ImageStore.validate`, listed in `problems`)."""

    def __init__(self, message: str, problems: list[str] | None = None) -> None:
        super().__init__(message)
        self.problems = problems if problems is not None else [message]


def short_ref(ref: str) -> str:
    """The reference as quoted in messages: data URIs cut to their head and length."""
    if ref.startswith("data:") and len(ref) > _DATA_URI_SHOWN:
        return f"{ref[:_DATA_URI_SHOWN]}...({len(ref)} chars)"
    return ref


def _where(record_id: str, ref: str) -> str:
    return f"record {record_id!r}, image {short_ref(ref)!r}"


@dataclass(frozen=True)
class LoadedImage:
    """One image of a record: the source bytes (sent as-is to the rollout servers) and its size."""

    ref: str
    data: bytes
    width: int
    height: int
    record_id: str = ""  # for error messages only

    def pil(self) -> Image.Image:
        """The image decoded to RGB, exactly as the rollout server decodes the same bytes
        (rollout_engine/prompts.py: `Image.open(...).convert("RGB")`, no EXIF rotation, alpha dropped),
        so the learner's processor sees the pixels the servers saw."""
        try:
            with Image.open(io.BytesIO(self.data)) as im:
                return im.convert("RGB")
        except Exception as exc:  # PIL raises OSError, SyntaxError, struct.error, zlib.error, ...
            raise ImageError(f"{_where(self.record_id, self.ref)}: cannot be decoded ({_pil_reason(exc)})") from None

    def __repr__(self) -> str:  # the default would print every byte
        return f"LoadedImage(ref={short_ref(self.ref)!r}, {self.width}x{self.height}, {len(self.data)} bytes)"


@dataclass(frozen=True)
class _Source:
    key: str  # the resolved reference: cache key, and what two records sharing an image agree on
    path: Path | None = None
    inline: bytes | None = None


class _Problem(Exception):
    """What is wrong with one image, before it is attached to a record id and reference."""


def _pil_reason(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class ImageStore:
    """Resolves, validates and reads the images of a dataset's records."""

    def __init__(
        self,
        image_root: str | Path | None,
        dataset_path: str | Path,
        max_image_pixels: int,
        cache_images: int = 256,
    ) -> None:
        if max_image_pixels < 1:
            raise ValueError(f"max_image_pixels must be >= 1, got {max_image_pixels}")
        if cache_images < 0:
            raise ValueError(f"cache_images must be >= 0, got {cache_images}")
        self.dataset_path = Path(dataset_path)
        self.image_root = Path(image_root) if image_root is not None else self.dataset_path.parent
        self.max_image_pixels = max_image_pixels
        self.cache_images = cache_images
        self._cache: OrderedDict[str, tuple[bytes, int, int]] = OrderedDict()
        self._lock = threading.Lock()  # load() may be called from the rollout fan-out's threads
        # The job spec is the authority on source image size. PIL's decompression-bomb guard (89 Mpx
        # by default) would otherwise refuse images the spec allows, here and in the HF processor
        # that decodes the same images in this process; so raise it to the spec's limit, never lower.
        # Our own header check below runs first and gives the clear error for anything larger.
        if Image.MAX_IMAGE_PIXELS is not None and max_image_pixels > Image.MAX_IMAGE_PIXELS:
            Image.MAX_IMAGE_PIXELS = max_image_pixels

    # ------------------------------------------------------------------ resolution

    def _resolve(self, record_id: str, ref: str) -> _Source:
        if not ref.strip():
            raise ImageError(f"{_where(record_id, ref)}: empty image reference")
        if ref.startswith("data:"):
            return _Source(key=ref, inline=self._decode_data_uri(record_id, ref))
        if ref.startswith("file:"):
            parts = urlsplit(ref)
            if parts.netloc not in ("", "localhost"):
                raise ImageError(
                    f"{_where(record_id, ref)}: file URI names host {parts.netloc!r}; only local files "
                    "(file:///path) and data URIs are supported"
                )
            path = Path(unquote(parts.path))
            if not path.is_absolute():
                raise ImageError(
                    f"{_where(record_id, ref)}: a file URI needs an absolute path (file:///data/a.jpg); "
                    "write relative paths without file:"
                )
        elif _REMOTE.match(ref):
            scheme = ref.split("://", 1)[0]
            raise ImageError(
                f"{_where(record_id, ref)}: {scheme}:// images are not fetched; only local files "
                "(relative or absolute paths, file:// URIs) and data:image/...;base64 URIs are supported"
            )
        else:
            path = Path(ref)
            if not path.is_absolute():
                path = self.image_root / path
        path = Path(os.path.abspath(path))
        return _Source(key=str(path), path=path)

    @staticmethod
    def _decode_data_uri(record_id: str, ref: str) -> bytes:
        m = _DATA_URI.match(ref)
        if m is None:
            raise ImageError(f"{_where(record_id, ref)}: malformed data URI; expected data:image/<fmt>;base64,<data>")
        mime, params = m["mime"].strip().lower(), m["params"].lower().split(";")
        if not mime.startswith("image/"):
            raise ImageError(
                f"{_where(record_id, ref)}: data URI has media type {mime or '(none)'!r}; "
                "expected data:image/<fmt>;base64,<data>"
            )
        if "base64" not in params:
            raise ImageError(
                f"{_where(record_id, ref)}: data URI is not base64-encoded; expected data:image/<fmt>;base64,<data>"
            )
        try:
            data = base64.b64decode("".join(m["payload"].split()), validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ImageError(f"{_where(record_id, ref)}: data URI payload is not valid base64 ({exc})") from None
        if not data:
            raise ImageError(f"{_where(record_id, ref)}: data URI holds no bytes")
        return data

    # ------------------------------------------------------------------ inspection

    def _too_large(self, width: int, height: int) -> str:
        return (
            f"is {width}x{height} = {width * height} pixels, more than spec.model.vision.maxImagePixels "
            f"({self.max_image_pixels})"
        )

    def _open(self, source: _Source, data: bytes | None = None) -> Image.Image:
        """Open (header only) and check the size before anything is decoded."""
        fp: io.BytesIO | Path
        if data is not None:
            fp = io.BytesIO(data)
        elif source.inline is not None:
            fp = io.BytesIO(source.inline)
        else:
            assert source.path is not None
            fp = source.path
        with warnings.catch_warnings():
            # Between PIL's limit and twice it PIL only warns; our check below decides instead.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            try:
                im = Image.open(fp)
            except Image.DecompressionBombError as exc:
                # Only past 2x PIL's limit, which __init__ keeps >= max_image_pixels: too large for us too.
                m = _BOMB_PIXELS.search(str(exc))
                size = f"{m[1]} pixels" if m else f"more than {2 * (Image.MAX_IMAGE_PIXELS or 0)} pixels"
                raise _Problem(
                    f"is {size}, more than spec.model.vision.maxImagePixels ({self.max_image_pixels})"
                ) from None
            except FileNotFoundError:
                raise _Problem(f"file {fp} does not exist") from None
            except IsADirectoryError:
                raise _Problem(f"{fp} is a folder, not an image file") from None
            except UnidentifiedImageError:
                fmt = _sniff(data if data is not None else source.inline, source.path)
                if fmt:  # PIL hides why its plugin gave up; the signature tells a cut file from a non-image
                    raise _Problem(f"starts like a {fmt} file but its header is corrupt or truncated") from None
                raise _Problem("is not an image PIL can read (not an image, or an unknown format)") from None
            except OSError as exc:
                if exc.errno is not None:  # the system's: permissions, I/O error, ...
                    raise _Problem(f"cannot be read ({exc.strerror or exc})") from None
                # PIL's own OSError ("Truncated File Read"): the file ends inside its header.
                raise _Problem(f"has a corrupt or truncated header ({_pil_reason(exc)})") from None
            except Exception as exc:  # a corrupt header: SyntaxError, struct.error, ValueError, ...
                raise _Problem(f"has a corrupt or truncated header ({_pil_reason(exc)})") from None
        width, height = im.size
        if width * height > self.max_image_pixels:
            im.close()
            raise _Problem(self._too_large(width, height))
        return im

    def _inspect(self, source: _Source) -> tuple[int, int]:
        """Size of a valid image; `_Problem` if it is missing, unreadable, too large or corrupt."""
        im = self._open(source)
        width, height, fmt = im.size[0], im.size[1], im.format
        try:
            # PNG's verify walks every chunk and checks its CRC without inflating pixel data, so a
            # truncated or bit-flipped PNG fails here. Most other formats' verify does nothing.
            im.verify()
        except Exception as exc:
            raise _Problem(f"is corrupt or truncated ({fmt}: {_pil_reason(exc)})") from None
        finally:
            im.close()
        if fmt == "PNG":
            return width, height
        if fmt == "JPEG" and self._jpeg_ends_cleanly(source):
            # A complete JPEG ends with the EOI marker; checking it costs one small read instead of
            # a decode. Files without it (truncated, or trailing bytes) get the full decode below.
            return width, height
        # Formats whose verify() checks nothing (and JPEGs without EOI): decode once to be sure.
        # Bounded by max_image_pixels, and rare in detection datasets.
        im = self._open(source)
        try:
            im.load()
        except Exception as exc:
            raise _Problem(f"is corrupt or truncated ({fmt}: {_pil_reason(exc)})") from None
        finally:
            im.close()
        return width, height

    @staticmethod
    def _jpeg_ends_cleanly(source: _Source) -> bool:
        if source.inline is not None:
            tail = source.inline[-64:]
        else:
            assert source.path is not None
            with source.path.open("rb") as f:
                f.seek(max(0, source.path.stat().st_size - 64))
                tail = f.read()
        return tail.rstrip(b"\x00\r\n ").endswith(b"\xff\xd9")

    # ------------------------------------------------------------------ public API

    def inspect_file(self, path: str | Path) -> tuple[int, int]:
        """(width, height) of the image file at `path`, checked as `validate` checks a record's image
        (opens, verifies, decodes where verify checks nothing, within max_image_pixels); `ImageError`
        saying why not. For tools that vet images before records exist (learner/data/coco.py)."""
        try:
            return self._inspect(_Source(key=str(path), path=Path(path)))
        except _Problem as exc:
            raise ImageError(f"{path}: {exc}") from None

    def validate(self, records: Iterable[Record]) -> None:
        """Check every image of every record; raise one `ImageError` listing the problems found."""
        problems: list[str] = []
        checked: dict[str, tuple[int, int] | str] = {}  # resolved key -> size, or what is wrong
        for record in records:
            for ref in record.images:
                try:
                    source = self._resolve(record.id, ref)
                except ImageError as exc:
                    problems.append(str(exc))
                    continue
                if source.key not in checked:
                    try:
                        checked[source.key] = self._inspect(source)
                    except _Problem as exc:
                        checked[source.key] = str(exc)
                outcome = checked[source.key]
                if isinstance(outcome, str):
                    problems.append(f"{_where(record.id, ref)}: {outcome}")
                elif len(record.images) == 1 and outcome != (record.width, record.height):
                    problems.append(self._mismatch(record, ref, *outcome))
        if problems:
            listed = "\n".join(f"  - {p}" for p in problems[:MAX_LISTED_PROBLEMS])
            more = len(problems) - MAX_LISTED_PROBLEMS
            tail = f"\n  ... and {more} more" if more > 0 else ""
            noun = "problem" if len(problems) == 1 else "problems"
            raise ImageError(f"dataset {self.dataset_path}: {len(problems)} image {noun}:\n{listed}{tail}", problems)

    @staticmethod
    def _mismatch(record: Record, ref: str, width: int, height: int) -> str:
        return (
            f"{_where(record.id, ref)}: image is {width}x{height} but the record says "
            f"width={record.width}, height={record.height} (ground truth is in the record's pixel coordinates)"
        )

    def load(self, record: Record) -> list[LoadedImage]:
        """The record's images, bytes as stored; read from disk once while they stay in the cache."""
        out = []
        for ref in record.images:
            source = self._resolve(record.id, ref)
            with self._lock:
                entry = self._cache.get(source.key)
                if entry is not None:
                    self._cache.move_to_end(source.key)
            if entry is None:
                entry = self._read(record.id, ref, source)
                with self._lock:
                    if self.cache_images:
                        self._cache[source.key] = entry
                        self._cache.move_to_end(source.key)
                        while len(self._cache) > self.cache_images:
                            self._cache.popitem(last=False)
            data, width, height = entry
            if len(record.images) == 1 and (width, height) != (record.width, record.height):
                raise ImageError(self._mismatch(record, ref, width, height))
            out.append(LoadedImage(ref=ref, data=data, width=width, height=height, record_id=record.id))
        return out

    def _read(self, record_id: str, ref: str, source: _Source) -> tuple[bytes, int, int]:
        try:
            if source.inline is not None:
                data = source.inline
            else:
                assert source.path is not None
                try:
                    data = _read_file(source.path)
                except FileNotFoundError:
                    raise _Problem(
                        f"file {source.path} does not exist (it was there when the dataset was validated)"
                    ) from None
                except IsADirectoryError:
                    raise _Problem(f"{source.path} is a folder, not an image file") from None
                except OSError as exc:
                    raise _Problem(f"cannot be read ({exc.strerror or exc})") from None
            im = self._open(source, data)  # header of the bytes just read: the file may have changed
            im.close()
        except _Problem as exc:
            raise ImageError(f"{_where(record_id, ref)}: {exc}") from None
        return data, im.size[0], im.size[1]


_SIGNATURES = (
    (b"\x89PNG\r\n\x1a\n", "PNG"),
    (b"\xff\xd8\xff", "JPEG"),
    (b"GIF8", "GIF"),
    (b"BM", "BMP"),
    (b"II*\x00", "TIFF"),
    (b"MM\x00*", "TIFF"),
)


def _sniff(data: bytes | None, path: Path | None) -> str | None:
    """The image format a file's first bytes announce, if any."""
    if data is None and path is not None:
        try:
            with path.open("rb") as f:
                data = f.read(16)
        except OSError:
            return None
    head = (data or b"")[:16]
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "WebP"
    return next((fmt for magic, fmt in _SIGNATURES if head.startswith(magic)), None)


def _read_file(path: Path) -> bytes:
    """One image file's bytes (its own function so tests can count the reads)."""
    return path.read_bytes()
