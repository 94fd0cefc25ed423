"""KV blocks through a real Mooncake store: saved by one engine process, loaded by another,
byte for byte, under vLLM's connector's keys and sizes, and nothing leaves loopback."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request

import pytest

from publishers.engine.block_hash import BlockHasher

pytestmark = pytest.mark.needs("store")

MODEL = "tiny-llama"
PROMPT_TOKENS = 4096
BLOCK_SIZE = 32
DIGESTS = BlockHasher("sha256", "0").block_digests(list(range(PROMPT_TOKENS)), BLOCK_SIZE)

LOAD_IN_ANOTHER_PROCESS = """
import json, sys
from publishers.mooncake_store import KVBlockShape, KVBlockStore, StoreAddress, kv_block
master, metadata, digests = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
digests = [bytes.fromhex(d) for d in digests]
shape = KVBlockShape(layers=2, kv_heads=2, block_size=32, head_dim=32)
store = KVBlockStore(StoreAddress(master, metadata), "tiny-llama")
loaded = store.get(digests, shape)
store.close()
print(json.dumps([b is not None and b.equal(kv_block(shape, d)) for b, d in zip(loaded, digests)]))
"""


@pytest.fixture(scope="module")
def shape():
    from publishers.mooncake_store import KVBlockShape

    return KVBlockShape(layers=2, kv_heads=2, block_size=BLOCK_SIZE, head_dim=32)


@pytest.fixture(scope="module")
def saver(real_store):
    from publishers.mooncake_store import KVBlockStore

    store = KVBlockStore(real_store.address, MODEL)
    yield store
    store.close()


def test_a_prompt_saved_by_one_engine_loads_byte_identical_in_another(
    real_store, saver, shape
) -> None:
    """One batch each way; the objects are the connector's: its keys, 32 KiB each."""
    from publishers.mooncake_store import block_key, kv_block

    started = time.perf_counter()
    saver.put(DIGESTS, [kv_block(shape, digest) for digest in DIGESTS])
    put_s = time.perf_counter() - started
    assert saver.contains(DIGESTS) == [True] * len(DIGESTS)
    result = subprocess.run(
        [sys.executable, "-c", LOAD_IN_ANOTHER_PROCESS, real_store.address.master]
        + [real_store.address.metadata_url, json.dumps([d.hex() for d in DIGESTS])],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == [True] * len(DIGESTS)
    megabytes = len(DIGESTS) * shape.nbytes / 2**20
    print(f"saved {megabytes:.1f} MiB ({PROMPT_TOKENS} tokens) in {put_s * 1000:.0f} ms")

    key = block_key(MODEL, DIGESTS[0])
    with urllib.request.urlopen(f"{real_store.admin_url}/query_key?key={key}", timeout=5) as r:
        replicas = json.load(r)["data"]
    assert [replica["size_"] for replica in replicas] == [32768]


def test_unknown_blocks_are_absent_and_load_as_none(saver, shape) -> None:
    from publishers.mooncake_store import kv_block

    unknown = [bytes([n]) * 32 for n in range(3)]
    assert saver.contains(unknown) == [False, False, False]
    assert saver.get(unknown[:1], shape) == [None]
    with pytest.raises(ValueError, match="one block per digest"):
        saver.put(unknown, [kv_block(shape, unknown[0])])


def test_store_traffic_stays_on_loopback(real_store, saver, shape) -> None:
    """Master, store process and clients talk over 127.0.0.1, the transfer engine's data
    path included: it binds the first non-loopback interface's address unless
    ``MC_TCP_BIND_ADDRESS`` says otherwise (``LOOPBACK_ENV``, which ``LocalStore`` and a
    loopback client set)."""
    from publishers.mooncake_store import kv_block

    digest = bytes(32)
    saver.put([digest], [kv_block(shape, digest)])
    [block] = saver.get([digest], shape)
    assert block is not None and block.equal(kv_block(shape, digest))
    output = subprocess.run(
        ["ss", "-tnH", "state", "established"], capture_output=True, text=True, timeout=10
    ).stdout
    peers = {field.rsplit(":", 1)[0] for line in output.splitlines() for field in line.split()[2:4]}
    addresses = {peer.strip("[]").removeprefix("::ffff:") for peer in peers}
    assert addresses and addresses <= {"127.0.0.1", "::1"}, addresses
