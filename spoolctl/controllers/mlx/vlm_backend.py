"""mlx-vlm backend: loads one vision-language model and runs it for the VLM controller.

The only module of spoolctl that imports ``mlx_vlm`` (lazily, in
``MlxVlmBackend.__init__``); importing it works without mlx-vlm. It encodes prompts
with their images, prefills, continues a snapshot, and turns a snapshot into mlx-vlm's
own exact-snapshot bytes (``DiskBlockStore.save_exact_cache``, layout
``exact_cache_v1``) and back. What an entry is (key, image identity, manifest fields)
is ``vlm.VlmEntryFormat``; the controller is ``vlm.MlxVlmCacheController``.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, cast

from spoolctl.errors import ConfigError
from spoolctl.store import hash_bytes

from ..contract import ImageInput
from ..local.mlx_format import CacheFormatError, model_digest, slice_caches
from ..local.vlm_prompt import ImageIdentity


class _Tokenizer(Protocol):
    """The part of the processor's tokenizer this backend uses."""

    def convert_ids_to_tokens(self, ids: int) -> str: ...

    def decode(self, token_ids: list[int]) -> str: ...

KIND = "mlx"
OBJECT_NAME = "snapshot"
SNAPSHOT_LAYOUT = "exact_cache_v1"
#: Largest image file spoolctl decodes (a decompression bomb guard on top of PIL's).
MAX_IMAGE_FILE = 64 << 20
VISION_CACHE_SIZE = 20


def snapshot_format(mlx_vlm_version: str) -> str:
    """The snapshot format id: mlx-vlm's exact-snapshot layout and minor series."""
    parts = mlx_vlm_version.split(".")
    series = ".".join(parts[:2]) if len(parts) >= 2 else mlx_vlm_version
    return f"mlx-vlm-{SNAPSHOT_LAYOUT}/{series}"


@contextlib.contextmanager
def _hub_offline():
    """Keep mlx-vlm's processor helpers off the network while loading a local directory
    (the Qwen helper otherwise asks the hub for an optional file); an explicit
    ``HF_HUB_OFFLINE`` setting of the user wins, and the variable is restored after."""
    previous = os.environ.get("HF_HUB_OFFLINE")
    if previous is None:
        os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("HF_HUB_OFFLINE", None)


@dataclass
class VlmSnapshot:
    """A loaded or prefilled prompt cache and the token ids it covers."""

    cache: list[Any]
    token_ids: tuple[int, ...]
    extra_hash: int


@dataclass(frozen=True)
class NormalizedImage:
    """A decoded image after RGB conversion and the ``max_image_size`` resize."""

    image: Any  # PIL.Image.Image
    identity: ImageIdentity


class MlxVlmBackend:
    """Loads one mlx-vlm model and runs it: encoding, prefill, snapshot codec, generation.

    ``model`` is a local model directory ``mlx_vlm.load`` reads. Forward passes are
    serialized by a lock (the model object also keeps per-prompt mRoPE state).
    """

    kind = KIND

    def __init__(self, model: str | os.PathLike[str]):
        try:
            import mlx.core as mx
            import mlx_vlm
            from mlx_vlm import apc
            from mlx_vlm.models import cache as vlm_cache
            from mlx_vlm.utils import prepare_inputs
            from mlx_vlm.vision_cache import VisionFeatureCache
            from PIL import Image
        except ImportError as exc:
            raise ConfigError(f"mlx-vlm is not usable here ({exc})",
                              fix="pip install 'spoolctl[vlm]' (see docs/controllers-mlx-vlm.md)"
                              ) from None
        self._mx, self._apc, self._cache_mod = mx, apc, vlm_cache
        self._mlx_vlm, self._prepare_inputs, self._Image = mlx_vlm, prepare_inputs, Image
        self.mlx_vlm_version = str(getattr(mlx_vlm, "__version__", "unknown"))
        self.mlx_version = str(mx.__version__)  # type: ignore[attr-defined]  # not in mlx's stub
        self.format = snapshot_format(self.mlx_vlm_version)
        self.model_name = os.fspath(model)
        self.model_dir = Path(self.model_name).expanduser()
        if not self.model_dir.is_dir():
            raise ConfigError("model path is not a directory", path=self.model_dir,
                              fix="pass a local mlx-vlm model directory")
        self.model_dir = self.model_dir.resolve()
        # What params.model is normalised to, and the path any spelling of it resolves to.
        self.model_id = str(self.model_dir)
        self.model_path = self.model_dir
        self._lock = threading.RLock()
        try:
            with _hub_offline():
                self.model, self.processor = mlx_vlm.load(str(self.model_dir))
        except Exception as exc:  # mlx-vlm raises many types for an unusable directory
            raise ConfigError(f"mlx-vlm cannot load the model: {exc}", path=self.model_dir,
                              fix="pass a model directory mlx-vlm supports") from None
        # A processor without a tokenizer attribute is the tokenizer itself.
        self.tokenizer = cast(_Tokenizer, getattr(self.processor, "tokenizer", self.processor))
        self.vision_cache = VisionFeatureCache(max_size=VISION_CACHE_SIZE)
        self.uses_vision_cache = hasattr(self.model, "encode_image") or \
            hasattr(self.model, "encode_images")
        self.placeholder = self._image_placeholder()
        self._probe()
        self._identity = {
            "framework": "mlx-vlm",
            "mlx_vlm_version": self.mlx_vlm_version,
            "mlx_version": self.mlx_version,
            "snapshot_format": self.format,
            "model": str(self.model_dir),
            "model_digest": model_digest(self.model_dir),
            "model_type": str(getattr(self.model.config, "model_type", "")),
            "dtype": self.dtype,
            "device": self.device,
        }

    # -- setup ---------------------------------------------------------------------------

    def _image_placeholder(self) -> str:
        """The text mlx-vlm's processor expands into one image's tokens."""
        cfg = self.model.config
        token = getattr(self.processor, "image_token", None)
        if not token:
            idx = getattr(cfg, "image_token_id", None) or getattr(cfg, "image_token_index", None)
            if idx is None:
                raise ConfigError("this model declares no image token", path=self.model_dir,
                                  fix="use a vision-language model mlx-vlm supports")
            token = self.tokenizer.convert_ids_to_tokens(int(idx))
        start = getattr(cfg, "vision_start_token_id", None)
        end = getattr(cfg, "vision_end_token_id", None)
        if start is not None and end is not None:  # Qwen-VL style framing
            return (self.tokenizer.convert_ids_to_tokens(int(start)) + token +
                    self.tokenizer.convert_ids_to_tokens(int(end)))
        return token

    def _probe(self) -> None:
        cache = self.new_cache()
        classes = {type(c).__name__ for c in cache}
        if classes != {"KVCache"}:
            raise ConfigError(f"model uses mlx-vlm cache types {sorted(classes)}; spoolctl "
                              "supports language models whose prompt cache is plain KVCache",
                              path=self.model_dir, fix="use a full-attention VLM (Qwen2-VL...)")
        self.num_layers = len(cache)
        from mlx.utils import tree_flatten

        # tree_flatten returns a list of (path, array) pairs when given no destination
        flat = cast(list[tuple[str, Any]],
                    tree_flatten(self.model.language_model.parameters()))
        first = next(iter(p for _, p in flat), None)
        self.dtype = str(first.dtype).rsplit(".", 1)[-1] if first is not None else "unknown"
        mx = self._mx
        self.device = "gpu" if mx.default_device().type == mx.DeviceType.gpu else "cpu"
        eos = getattr(self.model.config, "eos_token_id", None)
        eos = eos if isinstance(eos, list) else [eos]
        tok_eos = getattr(self.tokenizer, "eos_token_id", None)
        self._eos = {int(t) for t in [*eos, tok_eos] if t is not None}

    def identity(self) -> dict[str, str]:
        return dict(self._identity)

    # -- images and encoding -----------------------------------------------------------------

    def load_images(self, images: Sequence[ImageInput],
                    max_image_size: int | None) -> tuple[NormalizedImage, ...]:
        """Decode, convert to RGB and resize (longest edge <= ``max_image_size``) each
        image; ConfigError naming the file if it cannot be read as an image."""
        out = []
        for index, ref in enumerate(images):
            path = Path(ref.source).expanduser()
            try:
                if path.stat().st_size > MAX_IMAGE_FILE:
                    raise ConfigError("image file is larger than 64 MiB", path=path,
                                      fix="pass a smaller image")
                with self._Image.open(path) as im:
                    im.load()
                    img = im.convert("RGB") if im.mode != "RGB" else im.copy()
            except FileNotFoundError:
                raise ConfigError("image file not found", path=path,
                                  fix="check the image path") from None
            except (OSError, ValueError, self._Image.DecompressionBombError) as exc:
                raise ConfigError(f"cannot read the image: {exc}", path=path,
                                  fix="pass a PNG or JPEG file") from None
            if max_image_size is not None and max(img.size) > max_image_size:
                ratio = max_image_size / max(img.size)
                img = img.resize((max(1, int(img.width * ratio)),
                                  max(1, int(img.height * ratio))))
            ident = ImageIdentity(index=index, before=ref.before, mode=img.mode,
                                  width=img.width, height=img.height,
                                  pixels_digest=hash_bytes(img.tobytes()))
            out.append(NormalizedImage(img, ident))
        return tuple(out)

    def encode(self, text: str, images: Sequence[NormalizedImage]) -> dict[str, Any]:
        """mlx-vlm's model inputs for ``text`` (with one placeholder per image)."""
        from mlx_vlm.generate.dispatch import should_add_special_tokens

        cfg = self.model.config
        with self._lock:
            inputs = self._prepare_inputs(
                self.processor, images=[i.image for i in images] or None, prompts=text,
                image_token_index=getattr(cfg, "image_token_index", None)
                or getattr(cfg, "image_token_id", None),
                add_special_tokens=should_add_special_tokens(cfg.model_type, self.processor))
        ids = [int(t) for t in inputs["input_ids"].flatten().tolist()]
        return {"ids": ids, "inputs": dict(inputs)}

    # -- caches -----------------------------------------------------------------------------

    def new_cache(self) -> list[Any]:
        return self._cache_mod.make_prompt_cache(self.model.language_model)

    def _copy(self, cache: Sequence[Any], keep: int) -> list[Any]:
        """An independent cache of the first ``keep`` tokens (slices are new arrays)."""
        if any(type(c).__name__ != "KVCache" or int(c.offset) < keep for c in cache):
            raise ValueError("not a prompt cache of this model or too short")
        return slice_caches(cache, keep, self._cache_mod.KVCache)

    def _kwargs(self, encoded: Mapping[str, Any]) -> dict[str, Any]:
        inputs = dict(encoded["inputs"])
        kwargs = {k: v for k, v in inputs.items()
                  if k not in ("input_ids", "pixel_values", "attention_mask")}
        kwargs.update(input_ids=inputs["input_ids"], pixel_values=inputs.get("pixel_values"),
                      mask=inputs.get("attention_mask"))
        return kwargs

    def _run(self, encoded: Mapping[str, Any], images: Sequence[NormalizedImage],
             max_tokens: int, **extra: Any) -> tuple[list[int], int]:
        """Greedy tokens from mlx-vlm and how many prompt tokens it reused from a cache."""
        out: list[int] = []
        reused = 0
        with self._lock:
            for r in self._mlx_vlm.stream_generate(
                    # mlx-vlm's load() adds the detokenizer its ProcessorLike type asks for
                    self.model, self.processor,  # type: ignore[arg-type]
                    "", image=[i.image for i in images] or None,
                    max_tokens=max_tokens, temperature=0.0, vision_cache=self.vision_cache,
                    **self._kwargs(encoded), **extra):
                reused = int(getattr(r, "cached_tokens", 0) or 0)
                if r.token is None:  # mlx-vlm's closing record when it generated nothing
                    break
                out.append(int(r.token))
                if int(r.token) in self._eos or len(out) >= max_tokens:
                    break
        return out, reused

    def prefill(self, encoded: Mapping[str, Any], images: Sequence[NormalizedImage],
                extra_hash: int) -> VlmSnapshot:
        """A fresh snapshot of the prompt cache after ``encoded`` (cold prefill)."""
        n = len(encoded["ids"])
        cache = self.new_cache()
        self._run(encoded, images, 1, prompt_cache=cache)
        # Decoding one token may have appended it (and its successor) to the cache.
        return VlmSnapshot(self._copy(cache, n), tuple(encoded["ids"]), extra_hash)

    def serialize(self, snap: VlmSnapshot, cache_hash: int) -> tuple[dict[str, bytes], dict]:
        """mlx-vlm exact-snapshot bytes (safetensors) and the layout meta."""
        with tempfile.TemporaryDirectory(prefix="spoolctl-vlm-") as tmp:
            store = self._apc.DiskBlockStore(Path(tmp), "snap", num_workers=1)
            try:
                with self._lock:
                    ok = store.save_exact_cache(cache_hash, list(snap.token_ids),
                                                snap.extra_hash, snap.cache, synchronous=True)
            finally:
                store.close()
            files = sorted((Path(tmp) / "snap").glob("exact_*.safetensors"))
            if not ok or len(files) != 1:
                raise ValueError("mlx-vlm did not write an exact snapshot")
            data = files[0].read_bytes()
            name = files[0].name
        layout = {"format": self.format, "snapshot_layout": SNAPSHOT_LAYOUT,
                  "mlx_vlm_version": self.mlx_vlm_version, "object": OBJECT_NAME,
                  "file_name": name, "cache_hash": str(cache_hash),
                  "extra_hash": str(snap.extra_hash), "layers": self.num_layers,
                  "classes": ["KVCache"] * self.num_layers, "dtype": self.dtype,
                  "token_count": len(snap.token_ids)}
        return {OBJECT_NAME: data}, layout

    def deserialize(self, objects: Mapping[str, Any], layout: Mapping[str, Any],
                    token_count: int) -> VlmSnapshot:
        """Rebuild a snapshot; CacheFormatError on any mismatch with this model."""
        expected = {"format": self.format, "snapshot_layout": SNAPSHOT_LAYOUT,
                    "object": OBJECT_NAME, "layers": self.num_layers,
                    "classes": ["KVCache"] * self.num_layers, "dtype": self.dtype,
                    "token_count": token_count}
        for name, want in expected.items():
            if layout.get(name) != want:
                raise CacheFormatError(f"snapshot layout {name}={layout.get(name)!r} does not "
                                       f"match this model ({want!r})")
        if set(objects) != {OBJECT_NAME}:
            raise CacheFormatError(f"entry holds objects {sorted(objects)}")
        name = str(layout.get("file_name", ""))
        if not (name.startswith("exact_") and name.endswith(".safetensors")
                and "/" not in name and len(name) == len("exact_") + 32 + len(".safetensors")):
            raise CacheFormatError("snapshot file name is not canonical")
        try:
            cache_hash, extra_hash = int(layout["cache_hash"]), int(layout["extra_hash"])
        except (KeyError, TypeError, ValueError):
            raise CacheFormatError("snapshot hashes are missing") from None
        with tempfile.TemporaryDirectory(prefix="spoolctl-vlm-") as tmp:
            (Path(tmp) / "snap").mkdir()
            (Path(tmp) / "snap" / name).write_bytes(objects[OBJECT_NAME])
            store = self._apc.DiskBlockStore(Path(tmp), "snap", num_workers=1)
            try:
                with self._lock:
                    got = store.load_exact_cache(cache_hash)
            except Exception as exc:  # mlx-vlm may raise on a malformed file
                raise CacheFormatError(f"mlx-vlm could not load the snapshot: {exc}") from None
            finally:
                store.close()
        if got is None:
            raise CacheFormatError("mlx-vlm rejected the snapshot (hash, layout or tensors)")
        token_ids, got_extra, cache = got
        if got_extra != extra_hash or len(token_ids) != token_count:
            raise CacheFormatError("snapshot extra_hash or token count does not match")
        if len(cache) != self.num_layers or any(
                type(c).__name__ != "KVCache" or int(c.offset) != token_count for c in cache):
            raise CacheFormatError("loaded snapshot does not match its layout")
        return VlmSnapshot(list(cache), tuple(int(t) for t in token_ids), extra_hash)

    def generate(self, snap: VlmSnapshot | None, encoded: Mapping[str, Any],
                 images: Sequence[NormalizedImage], max_new_tokens: int) -> tuple[list[int], int]:
        """Greedy continuation of ``encoded``; returns (tokens, prompt tokens reused).

        A snapshot is continued through ``PromptCacheState`` (it primes Qwen-VL's
        mRoPE state) on a private copy, so the snapshot itself is never modified.
        The whole prompt is always passed (with its images); mlx-vlm reuses the
        snapshot only if its ids are a prefix and the rest is text.
        """
        from mlx_vlm import PromptCacheState

        ids = encoded["ids"]
        extra: dict[str, Any] = {}
        if snap is not None:
            keep = min(len(snap.token_ids), len(ids) - 1)
            if keep < 1 or tuple(ids[:keep]) != snap.token_ids[:keep]:
                raise ValueError("the snapshot is not a prefix of the prompt")
            state = PromptCacheState()
            state.update(list(snap.token_ids[:keep]), self._copy(snap.cache, keep))
            extra["prompt_cache_state"] = state
        return self._run(encoded, images, max_new_tokens, **extra)

    def decode(self, tokens: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(tokens)))
