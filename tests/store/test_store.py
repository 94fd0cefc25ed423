"""KV blocks through a real Mooncake store: saved by one engine process, loaded by another,
byte for byte, and nothing leaves loopback."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from tests.support.store import NAMESPACE_ADDRESS

MODEL = "tiny-llama"
PROMPT_TOKENS = 4096
BLOCK_SIZE = 32
HASHES = [0x9E3779B97F4A7C15 * (i + 1) % (1 << 64) for i in range(PROMPT_TOKENS // BLOCK_SIZE)]

LOAD_IN_ANOTHER_PROCESS = """
import json, sys
from publishers.store import KVBlockShape, KVBlockStore, StoreAddress, kv_block
master, metadata, hashes = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
shape = KVBlockShape(layers=2, kv_heads=2, block_size=32, head_dim=32)
store = KVBlockStore(StoreAddress(master, metadata), "tiny-llama")
same = [bool((store.get(h) == kv_block(shape, h)).all()) for h in hashes]
store.close()
print(json.dumps(same))
"""


@pytest.fixture(scope="module")
def shape():
    from publishers.store import KVBlockShape

    return KVBlockShape(layers=2, kv_heads=2, block_size=BLOCK_SIZE, head_dim=32)


@pytest.fixture(scope="module")
def saver(real_store):
    from publishers.store import KVBlockStore

    store = KVBlockStore(real_store.address, MODEL)
    yield store
    store.close()


def test_a_prompt_saved_by_one_engine_loads_byte_identical_in_another(
    real_store, saver, shape
) -> None:
    from publishers.store import kv_block

    started = time.perf_counter()
    for block_hash in HASHES:
        saver.put(block_hash, kv_block(shape, block_hash))
    put_s = time.perf_counter() - started
    assert saver.contains(HASHES) == [True] * len(HASHES)
    result = subprocess.run(
        [sys.executable, "-c", LOAD_IN_ANOTHER_PROCESS, real_store.address.master]
        + [real_store.address.metadata_url, json.dumps(HASHES)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == [True] * len(HASHES)
    megabytes = len(HASHES) * shape.nbytes / 2**20
    print(f"saved {megabytes:.1f} MiB ({PROMPT_TOKENS} tokens) in {put_s * 1000:.0f} ms")


def test_unknown_blocks_are_absent_and_a_missing_get_is_a_clear_error(saver) -> None:
    from publishers.store import StoreError

    assert saver.contains([1, 2, 3]) == [False, False, False]
    with pytest.raises(StoreError, match="not in the store"):
        saver.get(12345)


def test_store_traffic_never_leaves_its_namespace(real_store, saver, shape) -> None:
    """Master, store process and clients talk over 127.0.0.1, except the transfer engine's
    data path: it binds the first non-loopback interface's address whatever its host flag
    says (its legacy 127.0.0.1 binding collides with its own TCP handshake port), so the
    suite gives it a veth address private to the test's network namespace."""
    from publishers.store import kv_block

    saver.put(7, kv_block(shape, 7))
    assert bool((saver.get(7) == kv_block(shape, 7)).all())
    output = subprocess.run(
        ["ss", "-tnH", "state", "established"], capture_output=True, text=True, timeout=10
    ).stdout
    peers = {field.rsplit(":", 1)[0] for line in output.splitlines() for field in line.split()[2:4]}
    addresses = {peer.strip("[]").removeprefix("::ffff:") for peer in peers}
    assert addresses and addresses <= {"127.0.0.1", "::1", NAMESPACE_ADDRESS}, addresses
