"""`python -m embedserve.ray_data INPUT OUTPUT --archive MAR`: Parquet texts in, Parquet vectors
out, on a Ray cluster (or a local one Ray starts when none is given).

The input's rows keep every column but the text (`--keep-text` keeps it too) and gain `embedding`
(fixed_size_list<float32>, what vector databases import) and `error` (null, or why that row has no
vector). A pool of `--actors` actors, each with `--cpus-per-actor` CPUs (its threads) or
`--gpus-per-actor` GPUs, embeds the batches; Ray Data spreads them over the nodes, restarts an
actor that dies and retries its batch, so each row is written once."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

DEFAULT_BATCH_ROWS = 1024  # rows a map_batches call hands one actor: many requests' worth, a few seconds of work


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m embedserve.ray_data", description=__doc__.split("\n\n")[0])
    parser.add_argument("input", help="Parquet file or folder (any path Ray Data reads: local, s3://, gs://)")
    parser.add_argument("output", help="folder for the output Parquet files (existing files there are replaced)")
    parser.add_argument("--archive", required=True, help="the .mar built by ./build_mar.sh, readable on every node")
    parser.add_argument("--address", default=None,
                        help="the Ray cluster: 'auto' or host:port (default: RAY_ADDRESS, else a local Ray)")
    parser.add_argument("--actors", type=int, default=None,
                        help="actors embedding at once (default: as many as the cluster's CPUs hold, one CPU left "
                             "for reading and writing)")
    parser.add_argument("--cpus-per-actor", type=float, default=1.0, help="CPUs, and threads, per actor (default 1)")
    parser.add_argument("--gpus-per-actor", type=float, default=0.0, help="GPUs per actor (default 0: CPU)")
    parser.add_argument("--text-column", default="text")
    parser.add_argument("--keep-text", action="store_true", help="keep the text column in the output")
    parser.add_argument("--options", default="{}",
                        help='request options for every text, as JSON: e.g. \'{"prompt_name": "document"}\'')
    parser.add_argument("--batch-rows", type=int, default=DEFAULT_BATCH_ROWS)
    args = parser.parse_args(argv)
    if (args.actors is not None and args.actors < 1) or args.batch_rows < 1 or args.cpus_per_actor <= 0 or args.gpus_per_actor < 0:
        parser.error("--actors and --batch-rows must be >= 1, --cpus-per-actor > 0, --gpus-per-actor >= 0")
    try:
        args.options = json.loads(args.options)
    except ValueError as err:
        parser.error(f"--options is not JSON: {err}")
    if not isinstance(args.options, dict):
        parser.error("--options must be a JSON object")
    return args


def run(args: argparse.Namespace) -> dict:
    """Embeds the input into the output; the counts and time."""
    import pyarrow.parquet as pq
    import ray
    from ray.data import ActorPoolStrategy
    from ray.data._internal.savemode import SaveMode

    from embedserve.ray_data.embedder import ArchiveEmbedder

    ray.init(address=args.address, log_to_driver=False, configure_logging=False)
    actors = pool_size(args.actors, ray.cluster_resources(), args.cpus_per_actor, args.gpus_per_actor)
    started = time.perf_counter()
    # Blocks of one batch each: a Parquet file is read as few large blocks (Ray Data sizes them in
    # bytes, and texts are small), which would keep all but one actor idle.
    dataset = ray.data.read_parquet(args.input).repartition(target_num_rows_per_block=args.batch_rows)
    embedded = dataset.map_batches(
        ArchiveEmbedder,
        fn_constructor_kwargs={"archive": str(Path(args.archive).resolve()), "text_column": args.text_column,
                               "options": args.options, "drop_text": not args.keep_text},
        batch_format="pyarrow",
        batch_size=args.batch_rows,
        # At least one actor, so a lost node slows the job instead of stopping it.
        compute=ActorPoolStrategy(min_size=1, max_size=actors, initial_size=actors),
        num_cpus=args.cpus_per_actor,
        num_gpus=args.gpus_per_actor or None,
    )
    embedded.write_parquet(args.output, mode=SaveMode.OVERWRITE)
    seconds = time.perf_counter() - started
    errors = pq.read_table(args.output, columns=["error"]).column("error")
    return {"rows": len(errors), "actors": actors, "failed": len(errors) - errors.null_count,
            "seconds": round(seconds, 1), "rows_per_s": round(len(errors) / seconds, 1)}


class PoolError(ValueError):
    """The cluster cannot hold the actors asked for."""


def pool_size(asked: int | None, resources: dict, cpus_per_actor: float, gpus_per_actor: float) -> int:
    """The actors to run: `asked`, or as many as the cluster holds. Reading, listing and writing
    are Ray tasks of one CPU each: actors that take every CPU leave them none, and the job waits
    forever, so one CPU stays free."""
    cpus, gpus = float(resources.get("CPU", 0)), float(resources.get("GPU", 0))
    fit = int((cpus - 1) // cpus_per_actor)
    if gpus_per_actor:
        fit = min(fit, int(gpus // gpus_per_actor))
    if fit < 1:
        raise PoolError(f"the cluster has {cpus:g} CPUs and {gpus:g} GPUs: an actor of {cpus_per_actor:g} CPUs "
                        f"and {gpus_per_actor:g} GPUs, and one CPU for reading and writing, do not fit")
    if asked is not None and asked > fit:
        raise PoolError(f"the cluster has {cpus:g} CPUs and {gpus:g} GPUs: {asked} actors of {cpus_per_actor:g} "
                        f"CPUs and {gpus_per_actor:g} GPUs, and one CPU for reading and writing, do not fit; "
                        f"at most {fit}")
    return asked or fit


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        summary = run(args)
    except PoolError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"{summary['rows']} rows embedded into {args.output} by {summary['actors']} actors in "
          f"{summary['seconds']} s ({summary['rows_per_s']} rows/s), {summary['failed']} failed", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
