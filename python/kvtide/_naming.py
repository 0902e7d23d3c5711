"""Object names for the engine adapters' KV pages, derived so that two pages can share a name
only when their bytes mean the same thing.

Owns the namespace an adapter's objects live under and the check that an object already stored
under a name has the size the writer expected. Never looks inside values, and never lets a name
be built without a model identity: a page named without one could be served to another model.

A namespace is ``{engine}/v{LAYOUT_VERSION}/{digest}``: the digest is a BLAKE2b-128 of the
canonical JSON of every field that fixes what a page's bytes mean (model name and revision or
the user's cache tag, KV dtype and quantization, parallel sizes and this rank's place in them,
tokens per page, page and head layout). Any field that differs gives another digest, so a reader
of another configuration misses: it never gets other bytes and never a false hit.
"""

import hashlib
import json
from typing import Dict, Iterable, List, Optional, Sequence

import kvtide

# Bumped whenever the adapters lay a page out differently, so old objects are never read as new.
LAYOUT_VERSION = 1

_SCALARS = (str, int, float, bool, type(None))


class IdentityError(ValueError):
    """The engine's configuration does not say enough to name pages safely."""


class Namespace:
    """The prefix every object of one (engine, model, layout, rank) configuration lives under."""

    def __init__(self, engine: str, identity: Dict[str, object]):
        if not identity.get("model") and not identity.get("cache_tag"):
            raise IdentityError(
                f"kvtide.{engine}: no model identity (neither a model name nor a cache tag): pages "
                "named without one could be served to another model; set the model name or "
                "'kvtide_cache_tag' in the backend's extra config")
        for name, value in identity.items():
            if not isinstance(value, _SCALARS):
                raise IdentityError(f"kvtide.{engine}: identity field {name!r} is a {type(value).__name__}, "
                                    "expected a string, number, bool or None")
        self.engine = engine
        self.identity = dict(identity, layout_version=LAYOUT_VERSION)
        canonical = json.dumps({"engine": engine, **self.identity}, sort_keys=True, separators=(",", ":"))
        self.digest = hashlib.blake2b(canonical.encode(), digest_size=16).hexdigest()
        self.prefix = f"{engine}/v{LAYOUT_VERSION}/{self.digest}"

    def name(self, *parts: object) -> str:
        return "/".join([self.prefix, *(str(p) for p in parts)])

    def __repr__(self) -> str:
        return f"Namespace({self.prefix}, {self.identity})"


def dtype_name(dtype: object) -> Optional[str]:
    """A torch or numpy dtype as a stable string ('torch.bfloat16' -> 'bfloat16')."""
    if dtype is None:
        return None
    text = str(dtype)
    return text[len("torch."):] if text.startswith("torch.") else text


def settle_puts(store, names: Sequence[str], sizes: Sequence[int], results: Sequence[object]) -> List[bool]:
    """Per object: True when the put stored it, or when an object already stored under that name
    has exactly the size this writer meant to store (another rank's or an earlier identical
    write). An existing object of another size is a failure, never counted as stored."""
    done = [r is None for r in results]
    existing = [i for i, r in enumerate(results) if isinstance(r, kvtide.AlreadyExists)]
    if existing:
        stored = store.batch_get_size([names[i] for i in existing])
        for i, size in zip(existing, stored):
            done[i] = isinstance(size, int) and not isinstance(size, bool) and size == int(sizes[i])
    return done


def all_true(flags: Iterable[object]) -> bool:
    return all(f is True for f in flags)
