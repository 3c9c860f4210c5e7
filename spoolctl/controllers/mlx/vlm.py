"""mlx-vlm controller: persistent prompt caches for vision-language models on MLX.

``MlxVlmCacheController`` is ``LocalCacheController`` with the ``VlmEntryFormat`` defined
here over an ``MlxVlmBackend`` (``vlm_backend``, the only module that imports ``mlx_vlm``).

* An entry is an exact snapshot of the language model's prompt cache in mlx-vlm's own
  exact-snapshot codec, stored as one verified object (``kind="mlx"``).
* Text-only and image prompts use two namespaces and a format marker of their own: no
  entry ever loads into another kind of controller.
* Image identity (normalized pixels, place in the prompt, ``max_image_size``) is part of
  the key, the meta and the snapshot's ``extra_hash``; any mismatch on load is a miss (the
  query runs cold; bad bytes are quarantined).
* Entries are exact-match only: no base selection, incremental prefill or trimming.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from spoolctl.errors import ConfigError
from spoolctl.store import Store, entry_id_for, hash_parts

from ..contract import CachePrepareParams
from ..local.deadlines import DEFAULT_LOOKUP_DEADLINE_S, DEFAULT_READ_DEADLINE_S
from ..local.decoding import DEFAULT, Decoding
from ..local.engine import DEFAULT_LOCK_TIMEOUT, DEFAULT_MEMORY_ENTRIES, LocalCacheController
from ..local.entry_format import Loaded, Plan, Prompt, check_common
from ..local.tokens import TokenPrefix, namespace_for
from ..local.vlm_prompt import (
    MODE_IMAGE,
    MODE_TEXT,
    extra_hash_of,
    images_digest,
    images_in_prefix,
    render_vlm,
)
from .vlm_backend import (
    KIND,
    MAX_IMAGE_FILE,
    OBJECT_NAME,
    SNAPSHOT_LAYOUT,
    VISION_CACHE_SIZE,
    MlxVlmBackend,
    NormalizedImage,
    VlmSnapshot,
    snapshot_format,
)

FORMAT = "spoolctl-mlx-vlm/v1"

__all__ = ["FORMAT", "KIND", "MAX_IMAGE_FILE", "OBJECT_NAME", "SNAPSHOT_LAYOUT",
           "VISION_CACHE_SIZE", "MlxVlmBackend", "MlxVlmCacheController", "NormalizedImage",
           "VlmEntryFormat", "VlmSnapshot", "snapshot_format"]


@dataclass(frozen=True)
class VlmPlanData:
    """The VLM part of a plan: mode, the prefix's normalized images and their digest,
    the snapshot ``extra_hash``, and the encoded prefix."""

    mode: str = MODE_TEXT
    images: tuple[NormalizedImage, ...] = ()
    image_digest: str = ""
    extra_hash: int = 0
    text: str = ""
    encoded: Any = field(default=None, compare=False, repr=False)


class VlmEntryFormat:
    """Exact-match mlx-vlm snapshot entries (see the module docstring)."""

    name = FORMAT
    noun = "an mlx-vlm entry"
    label = "mlx-vlm"
    kind = KIND
    bases = False  # a snapshot restores whole: no shorter base exists
    # On an encrypted store these go into the entry's sealed object: the
    # image digests and the hashes derived from them or from the prompt's key.
    sealed_meta = ("images", "image_digest", "image_count", "extra_hash")
    sealed_layout = ("cache_hash", "file_name", "extra_hash")

    def __init__(self, backend: MlxVlmBackend):
        self.vlm = backend
        self.identity = dict(backend.identity())
        self.namespaces = {mode: namespace_for(KIND, {**self.identity, "vlm_mode": mode})
                           for mode in (MODE_TEXT, MODE_IMAGE)}
        self.namespace = self.namespaces[MODE_TEXT]

    # -- keys and plans --------------------------------------------------------------------

    def _identify(self, params: CachePrepareParams
                  ) -> tuple[str, str, str, tuple[NormalizedImage, ...], str]:
        """(mode, namespace, key, prefix images, images digest) without tokenizing: what
        decides which entry a request may use."""
        images = self.vlm.load_images(images_in_prefix(params), params.max_image_size)
        mode = MODE_IMAGE if images else MODE_TEXT
        digest = images_digest([i.identity for i in images], params.max_image_size) \
            if images else ""
        key = hash_parts(b"spoolctl-vlm-key/v1", params.key().encode(), mode.encode(),
                         digest.encode())
        return mode, self.namespaces[mode], key, images, digest

    def entry_id(self, params: CachePrepareParams) -> str:
        _, namespace, key, _, _ = self._identify(params)
        return entry_id_for(KIND, namespace, key)

    def plan(self, params: CachePrepareParams) -> Plan | None:
        if not params.has_cacheable_prefix() and not params.images:
            return None
        mode, namespace, key, images, digest = self._identify(params)
        text = render_vlm(params, images_in_prefix(params), self.vlm.placeholder,
                          include_volatile=False)
        if not text:
            return None
        encoded = self.vlm.encode(text, images)
        if not encoded["ids"]:
            return None
        data = VlmPlanData(mode=mode, images=images, image_digest=digest,
                           extra_hash=extra_hash_of(digest) if digest else 0, text=text,
                           encoded=encoded)
        return Plan(params=params, key=key, namespace=namespace,
                    entry_id=entry_id_for(KIND, namespace, key),
                    prefix=TokenPrefix.from_segments([encoded["ids"]]),
                    group=params.group_hash(), elements=tuple(params.element_hashes()),
                    lead_segments=1 if params.tools else 0, extra=data)

    def prompt(self, params: CachePrepareParams, text: str) -> Prompt:
        images = self.vlm.load_images(params.images, params.max_image_size)
        rendered = render_vlm(params, params.images, self.vlm.placeholder,
                              include_volatile=True, prompt=text)
        if not rendered:
            raise ConfigError("the prompt is empty", fix="pass instructions, data or a prompt")
        encoded = self.vlm.encode(rendered, images)
        if not encoded["ids"]:
            raise ConfigError("the prompt tokenizes to nothing", fix="pass a non-empty prompt")
        return Prompt(list(encoded["ids"]), extra=(encoded, images))

    # -- entries ---------------------------------------------------------------------------

    def check(self, meta: Mapping[str, Any], plan: Plan | None, *,
              identity: Mapping[str, str] | None = None) -> TokenPrefix:
        """The common checks, then (with a plan) that the entry's mode and image identity
        are exactly the plan's."""
        prefix = check_common(meta, name=self.name, noun=self.noun,
                              identity=identity or self.identity)
        if plan is None:
            return prefix
        data: VlmPlanData = plan.extra
        want = {"vlm_mode": data.mode, "image_count": len(data.images),
                "images": [i.identity.to_meta() for i in data.images],
                "image_digest": data.image_digest,
                "max_image_size": plan.params.max_image_size if data.images else
                meta.get("max_image_size"),
                "extra_hash": str(data.extra_hash)}
        for name, value in want.items():
            if meta.get(name) != value:
                raise ValueError(f"entry {name} does not match the prompt")
        if meta["layout"].get("extra_hash") != str(data.extra_hash):
            raise ValueError("snapshot extra_hash does not match the prompt's images")
        return prefix

    def prefill(self, plan: Plan) -> VlmSnapshot:
        data: VlmPlanData = plan.extra
        return self.vlm.prefill(data.encoded, data.images, data.extra_hash)

    def serialize(self, cache: VlmSnapshot, plan: Plan) -> tuple[dict[str, Any], dict]:
        return self.vlm.serialize(cache, extra_hash_of(plan.key))

    def describe(self, plan: Plan) -> tuple[dict[str, Any], dict[str, Any]]:
        data: VlmPlanData = plan.extra
        meta = {"vlm_mode": data.mode, "image_count": len(data.images),
                "images": [i.identity.to_meta() for i in data.images],
                "image_digest": data.image_digest, "max_image_size": plan.params.max_image_size,
                "extra_hash": str(data.extra_hash),
                "vision_feature_cache": self.vlm.uses_vision_cache}
        return meta, {"vlm_mode": data.mode, "exact_only": True}

    def load(self, objects: dict[str, memoryview], meta: Mapping[str, Any],
             prefix: TokenPrefix, plan: Plan | None) -> VlmSnapshot:
        snap = self.vlm.deserialize(objects, dict(meta["layout"]), len(prefix))
        if snap.token_ids != prefix.tokens or (
                plan is not None and snap.extra_hash != plan.extra.extra_hash):
            raise ValueError("snapshot token ids differ from the manifest's")
        return snap

    # -- generation ----------------------------------------------------------------------------

    def fit(self, loaded: Loaded, prompt: Prompt) -> tuple[Any | None, int]:
        # The entry holds exactly the ids its key was prepared with; they must also be
        # the leading ids of this prompt (tokenization across the boundary may differ).
        if len(prompt.tokens) < 2 or not loaded.prefix.is_prefix_of(prompt.tokens):
            return None, 0
        return loaded.cache, len(loaded.prefix)

    def run(self, cache: VlmSnapshot | None, cached: int, prompt: Prompt,
            max_new_tokens: int, decoding: Decoding = DEFAULT) -> tuple[list[int], int]:
        if not decoding.over(0.0).greedy or decoding.seed is not None or \
                decoding.streamer is not None or decoding.extra:
            raise ConfigError("the mlx-vlm controller decodes greedily only",
                              fix="drop temperature / top_p / top_k / seed / streamer / "
                                  "generate_kwargs")
        encoded, images = prompt.extra
        out, reused = self.vlm.generate(cache, encoded, images, max_new_tokens)
        return out, reused if cache is not None else 0

    def decode(self, tokens: list[int]) -> str:
        return self.vlm.decode(tokens)


class MlxVlmCacheController(LocalCacheController):
    """Prompt caches for mlx-vlm models: ``LocalCacheController``'s store, memory LRU,
    coalescing, locks, release, close and generate, with exact-match VLM entries
    (``VlmEntryFormat``; see the module docstring). ``generate`` takes the params (or a
    handle) and a final prompt. ``tenant``: on an encrypted store, the tenant whose key
    seals the entries, with their token ids and image digests; as for
    ``LocalCacheController``. ``lookup_deadline`` / ``read_deadline``: as there.
    """

    def __init__(
        self,
        model: str | os.PathLike[str] | MlxVlmBackend,
        root: str | os.PathLike[str] | Store | None = None,
        *,
        max_bytes: int | None = None,
        memory_entries: int = DEFAULT_MEMORY_ENTRIES,
        lock_timeout: float = DEFAULT_LOCK_TIMEOUT,
        tenant: str | None = None,
        lookup_deadline: float = DEFAULT_LOOKUP_DEADLINE_S,
        read_deadline: float = DEFAULT_READ_DEADLINE_S,
    ):
        backend = model if isinstance(model, MlxVlmBackend) else MlxVlmBackend(model)
        if root is not None and not isinstance(root, Store):
            root = os.fspath(root)
        fmt = VlmEntryFormat(backend)
        super().__init__(backend, root, max_bytes=max_bytes, memory_entries=memory_entries,
                         lock_timeout=lock_timeout, entry_format=fmt, tenant=tenant,
                         lookup_deadline=lookup_deadline, read_deadline=read_deadline)
        self.vlm: MlxVlmBackend = backend
        self.namespaces = fmt.namespaces
