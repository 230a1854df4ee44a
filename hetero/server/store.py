"""A context store shared by replicas: documents' KV saved once, found by content, on storage every
replica can read (a directory: local disk for replicas on one host, a shared mount across hosts).

  kv/<key[:2]>/<key>.ctx   a document's KV in hetero's saved-context format (written atomically
                           by Engine.save_pin: a temporary name, then rename; CRC-checked and
                           fingerprint-checked by Engine.load_pin, which names any mismatch)
  names/<name>.json        a named context (POST /v1/contexts): its token ids, its messages (a chat
                           context) and adapter, written atomically
  adapters.json            the adapters served by name: {name: directory} (--adapters at start, then
                           POST /v1/load_lora_adapter / unload), written atomically; adapter
                           directories must be readable by every replica, as the store is

key = sha256 over the model's fingerprint (its weights' digest and the KV's shape:
hetero.offload.saved.fingerprint), the adapter's digest and the token ids: two replicas of one
model find each other's documents; another model, dtype or adapter never matches.

  who writes                       who reads
  the replica that prefilled it    any replica missing the document (load instead of prefill)
  the ingress (names)              every ingress replica (a request naming a context)
  the ingress (adapters.json)      every replica, before each request (loads and unloads to match)
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile

import numpy as np


class ContextStore:
    def __init__(self, root: str):
        self.root = os.path.abspath(root)
        for sub in ("kv", "names"):
            os.makedirs(os.path.join(self.root, sub), exist_ok=True)

    # ---- documents' KV, by content
    @staticmethod
    def key(fingerprint: dict, ids: list[int]) -> str:
        h = hashlib.sha256(json.dumps(fingerprint, sort_keys=True, default=str).encode())
        h.update(np.asarray(ids, dtype=np.int64).tobytes())
        return h.hexdigest()

    def path(self, key: str) -> str:
        return os.path.join(self.root, "kv", key[:2], f"{key}.ctx")

    def has(self, key: str) -> bool:
        return os.path.exists(self.path(key))

    def prepare(self, key: str) -> str:
        """The path a replica saves a document's KV to (its directory made)."""
        path = self.path(key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        return path

    def discard(self, key: str) -> None:
        """A file that failed its checks: removed, so the next replica prefills and saves it again."""
        try:
            os.unlink(self.path(key))
        except FileNotFoundError:
            pass

    # ---- named contexts
    def _name_path(self, name: str) -> str:
        return os.path.join(self.root, "names", f"{name}.json")

    def put_name(self, name: str, record: dict) -> None:
        _write_json(self._name_path(name), record)

    def get_name(self, name: str) -> dict | None:
        try:
            with open(self._name_path(name)) as f:
                return json.load(f)
        except FileNotFoundError:
            return None

    def delete_name(self, name: str) -> bool:
        try:
            os.unlink(self._name_path(name))
            return True
        except FileNotFoundError:
            return False

    def names(self) -> list[str]:
        return sorted(f[:-5] for f in os.listdir(os.path.join(self.root, "names")) if f.endswith(".json")
                      and not f.startswith("."))

    # ---- adapters served by name
    def adapters(self) -> dict[str, str]:
        """{name: directory} of the adapters requests may name ({} before any was set)."""
        try:
            with open(os.path.join(self.root, "adapters.json")) as f:
                return json.load(f)
        except FileNotFoundError:
            return {}

    def set_adapters(self, adapters: dict[str, str]) -> None:
        _write_json(os.path.join(self.root, "adapters.json"), dict(adapters))


def _write_json(path: str, record) -> None:
    """record as JSON at path, atomically: a temporary name beside it, then rename."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(record, f)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
