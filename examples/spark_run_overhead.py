"""The start-up cost of ``hora.spark.run`` beside ``hora.run``: both run a trivial function
on 2 ranks, 5 times each, in one process with one local Spark session.

    SPARK_LOCAL_IP=127.0.0.1 python examples/spark_run_overhead.py [--master 'local[2]']
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def trivial() -> int:
    return int(os.environ["HORA_RANK"])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--master", default="local[2]")
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args()
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    import hora
    import hora.spark

    start = time.perf_counter()
    spark = (
        SparkSession.builder.master(args.master)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("FATAL")
    print(f"SparkSession start: {time.perf_counter() - start:.2f} s")
    runs = [
        ("hora.spark.run", lambda: hora.spark.run(trivial, num_proc=2)),
        ("hora.run", lambda: hora.run(trivial, num_proc=2)),
    ]
    try:
        for name, call in runs:
            times = []
            for _ in range(args.repeat):
                start = time.perf_counter()
                assert call() == [0, 1]
                times.append(time.perf_counter() - start)
            rest = statistics.median(times[1:]) if len(times) > 1 else times[0]
            print(f"{name}: first {times[0]:.2f} s, median of the rest {rest:.2f} s")
    finally:
        spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
