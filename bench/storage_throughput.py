"""podtrain.storage throughput against the plain ways of moving the same bytes, side by side in one run.

    .venv/bin/python bench/storage_throughput.py [--mib 32] [--files 4] [--rounds 5] [--dir DIR]

S3 (a local moto server on loopback, started here; needs the `test` extra):
  write: podtrain's store (``open_write``: multipart, aborted on failure) against s3torchconnector's
         own ``S3Client.put_object`` (its public ``S3Writer``) writing the same bytes
  read:  ``store.read_into`` a preallocated buffer against ``S3Client.get_object(...).read()``
POSIX (``--dir``, default a temporary directory on this machine's disk):
  write: ``store.write_bytes`` (temp file, fsync, rename, directory fsync) against plain
         ``open().write()`` and against plain write + fsync (the same durability)
  read:  ``store.read_into`` a preallocated buffer against ``open().read()``
After one unmeasured warm-up, each round runs every variant once, in alternating order; the
figures are medians over rounds.
The moto server (Python, in this process) is the bottleneck of the S3 figures: the ratio says
whether podtrain's layer costs anything over the connector, not what S3 itself would deliver.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests"))  # the loopback S3 server the tests use

from podtrain.storage import open_store  # noqa: E402


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def s3_variants(payloads: list[bytes], bucket: str):
    """(label, write fn, read fn) for podtrain and for s3torchconnector's own client."""
    from s3torchconnector import S3ClientConfig
    from s3torchconnector._s3client import S3Client

    store = open_store(f"s3://{bucket}/podtrain")
    raw = S3Client(os.environ["AWS_REGION"], endpoint=os.environ["AWS_ENDPOINT_URL"],
                   s3client_config=S3ClientConfig(force_path_style=True))
    bufs = [bytearray(len(p)) for p in payloads]
    slice_ = 8 << 20

    def pt_write():
        for i, p in enumerate(payloads):
            with store.open_write(f"f{i}") as fh:
                fh.write(p)

    def pt_read():
        for i, b in enumerate(bufs):
            store.read_into(f"f{i}", 0, b)

    def raw_write():
        for i, p in enumerate(payloads):
            with raw.put_object(bucket, f"raw/f{i}") as w:
                view = memoryview(p)
                for j in range(0, len(p), slice_):
                    w.write(view[j:j + slice_])

    def raw_read():
        for i in range(len(payloads)):
            raw.get_object(bucket, f"raw/f{i}").read()

    return ("s3 podtrain store", pt_write, pt_read), ("s3 s3torchconnector client", raw_write, raw_read)


def posix_variants(payloads: list[bytes], folder: Path):
    """(label, write fn, read fn) for podtrain's atomic store, plain writes, plain writes + fsync."""
    store = open_store(folder / "podtrain")
    plain = folder / "plain"
    plain.mkdir(parents=True, exist_ok=True)
    bufs = [bytearray(len(p)) for p in payloads]

    def pt_write():
        for i, p in enumerate(payloads):
            store.write_bytes(f"f{i}", p)

    def pt_read():
        for i, b in enumerate(bufs):
            store.read_into(f"f{i}", 0, b)

    def plain_write(fsync: bool):
        def write():
            for i, p in enumerate(payloads):
                with open(plain / f"f{i}", "wb") as fh:
                    fh.write(p)
                    if fsync:
                        fh.flush()
                        os.fsync(fh.fileno())
        return write

    def plain_read():
        for i in range(len(payloads)):
            with open(plain / f"f{i}", "rb") as fh:
                fh.read()

    return (("posix podtrain store", pt_write, pt_read), ("posix plain open()", plain_write(False), plain_read),
            ("posix plain open()+fsync", plain_write(True), plain_read))


def run(variants, nbytes: int, rounds: int) -> dict[str, tuple[float, float]]:
    """Median MB/s (write, read) per variant label, variants interleaved and alternated per round."""
    times: dict[str, tuple[list, list]] = {v[0]: ([], []) for v in variants}
    for _, write, read in variants:  # warm-up, not measured: clients, connections, page cache
        write()
        read()
    for r in range(rounds):
        order = variants if r % 2 == 0 else variants[::-1]
        for label, write, _ in order:
            times[label][0].append(timed(write))
        for label, _, read in order:
            times[label][1].append(timed(read))
    mb = nbytes / 1e6
    return {k: (mb / statistics.median(w), mb / statistics.median(rd)) for k, (w, rd) in times.items()}


def report(title: str, results: dict[str, tuple[float, float]], base: str) -> None:
    print(f"\n{title}")
    print(f"  {'variant':30s} {'write MB/s':>11s} {'read MB/s':>10s}")
    for label, (w, r) in results.items():
        print(f"  {label:30s} {w:11.1f} {r:10.1f}")
    pw, pr = results[next(iter(results))]
    for label, (w, r) in results.items():
        if label != next(iter(results)):
            print(f"  ratio podtrain / {label}: write {pw / w:.2f}x, read {pr / r:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=32, help="MiB per file")
    ap.add_argument("--files", type=int, default=4, help="files per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", type=Path, default=None, help="POSIX directory (default: a temporary one)")
    ap.add_argument("--only", choices=["posix", "s3"], default=None, help="run one half")
    args = ap.parse_args()
    payloads = [os.urandom(args.mib << 20) for _ in range(args.files)]
    nbytes = sum(map(len, payloads))
    print(f"{args.files} files x {args.mib} MiB per round, {args.rounds} rounds, medians")

    if args.only != "s3":
        with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
            report(f"POSIX ({tmp})", run(posix_variants(payloads, Path(tmp)), nbytes, args.rounds), "plain")

    if args.only != "posix":
        from s3_server import restore_env, start_with_env

        server, saved = start_with_env()
        try:
            bucket = server.new_bucket()
            report(f"S3 (moto on {server.endpoint})", run(s3_variants(payloads, bucket), nbytes, args.rounds), "raw")
            assert server.incomplete_uploads(bucket) == [], "an upload was left incomplete"
        finally:
            server.stop()
            restore_env(saved)


if __name__ == "__main__":
    main()
