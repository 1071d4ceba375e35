#!/usr/bin/env python3
"""What a TensorFlow upgrade costs or gains: the headline benchmarks on two stacks, side by side.

Each stack is a virtual environment set up by ``scripts/setup.sh`` (``scripts/matrix.sh`` makes
``.venv-tf2.15`` and ``.venv-tf2.21``). Every round runs each benchmark once per stack, the stacks
in alternating order, on the same machine in one run:

* ``scaling.py --models cnn --transport mpi --max-np 2``: np=2 scaling efficiency and img/s;
* ``vs_horovod.py --launch 2 --transport mpi``: hvdtrain's step time / a plain Horovod loop's;
* ``vs_mwms.py``: hvdtrain's throughput / ``MultiWorkerMirroredStrategy``'s.

It prints each figure per stack (the median over rounds) and the second stack's over the first's,
the median of the rounds' own ratios (a slow spell hits both stacks of a round alike)::

    .venv/bin/python benchmarks/stacks.py --venvs .venv-tf2.15 .venv --rounds 2
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from typing import Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def _tables(stdout: str) -> List[List[Dict[str, str]]]:
    """The Markdown tables in ``stdout``, each a list of rows keyed by the header's cells."""
    found, lines = [], []
    for line in [*stdout.splitlines(), ""]:
        if line.startswith("|"):
            lines.append([cell.strip() for cell in line.strip().strip("|").split("|")])
        elif lines:
            header, _, *rows = lines
            found.append([dict(zip(header, row)) for row in rows])
            lines = []
    return found


def _number(cell: str) -> float:
    return float(re.search(r"-?[\d,]*\.?\d+", cell).group(0).replace(",", ""))


def _scaling(rows) -> Dict[str, float]:
    np2 = next(r for r in rows if r["np"] == "2")
    return {"np=2 scaling efficiency (seed CNN, sync BN, MPI)": _number(np2["scaling efficiency (range)"]),
            "np=2 img/s total (seed CNN, sync BN, MPI)": _number(np2["img/s total"])}


def _vs_horovod(rows) -> Dict[str, float]:
    return {f"hvdtrain / plain Horovod step time, {r['model']}": _number(r["hvdtrain / plain"]) for r in rows}


def _vs_mwms(rows) -> Dict[str, float]:
    return {f"hvdtrain / MWMS img/s, {r['seed CNN']}": _number(r["hvdtrain / MWMS"]) for r in rows}


# (script and arguments, the table's parser, figures where higher is better)
BENCHMARKS = [
    (["scaling.py", "--models", "cnn", "--transport", "mpi", "--max-np", "2", "--repeats", "1", "--no-ceiling"],
     _scaling),
    (["vs_horovod.py", "--launch", "2", "--transport", "mpi", "--rounds", "5"], _vs_horovod),
    (["vs_mwms.py", "--rounds", "1"], _vs_mwms),
]


def _run(venv: str, argv: List[str], plot: str) -> str:
    python = os.path.join(os.path.abspath(venv), "bin", "python")
    env = {**os.environ, "PATH": os.path.join(os.path.abspath(venv), "bin") + os.pathsep + os.environ["PATH"]}
    proc = subprocess.run([python, os.path.join(HERE, argv[0]), *argv[1:], "--plot", plot], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=1800)
    if proc.returncode:
        sys.exit(f"stacks.py: {venv}: {' '.join(argv)} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc.stdout


def _version(venv: str) -> str:
    python = os.path.join(os.path.abspath(venv), "bin", "python")
    code = "import sys, tensorflow as tf; print(f'TF {tf.__version__}, Python {sys.version.split()[0]}')"
    return subprocess.run([python, "-c", code], capture_output=True, text=True, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
                          timeout=300).stdout.strip() or venv


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--venvs", nargs=2, required=True, metavar=("BASE", "NEW"), help="two stacks' virtual environments")
    p.add_argument("--rounds", type=int, default=2, help="rounds; each runs every benchmark once per stack")
    a = p.parse_args(argv)
    if a.rounds < 1:
        p.error(f"--rounds must be >= 1, got {a.rounds}")
    names = [_version(v) for v in a.venvs]
    figures: Dict[str, Dict[int, List[float]]] = {}
    for r in range(a.rounds):
        order = [0, 1] if r % 2 == 0 else [1, 0]
        for script_args, parse in BENCHMARKS:
            for i in order:
                out = _run(a.venvs[i], script_args, plot=f"/tmp/hvdtrain-stacks-{i}.png")
                for key, value in parse(_tables(out)[-1]).items():
                    figures.setdefault(key, {0: [], 1: []})[i].append(value)
                print(f"round {r + 1}: {names[i]}: {script_args[0]} done", flush=True)
    print(f"\n{a.rounds} round(s), stacks alternating; medians over rounds, ratio = median of the rounds' "
          f"{names[1]} / {names[0]}\n")
    print(f"| figure | {names[0]} | {names[1]} | ratio |")
    print("| --- | --- | --- | --- |")
    for key, by_stack in figures.items():
        ratio = statistics.median(new / base for base, new in zip(by_stack[0], by_stack[1]))
        print(f"| {key} | {statistics.median(by_stack[0]):,.3f} | {statistics.median(by_stack[1]):,.3f} | {ratio:.3f} |")


if __name__ == "__main__":
    main()
