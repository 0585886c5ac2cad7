"""What the bench/ scripts share: paths that work from any directory, a
fresh output directory by default, and plots only where matplotlib is.
"""
import argparse
import datetime
import os
import socket
import sys
import tempfile

# The repository: this file's directory's parent.
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def repo_path(path):
    """`path` as given when it exists from here (or is absolute), else the
    same path under the repository (the built binaries' bazel-bin/...)."""
    if os.path.isabs(path) or os.path.exists(path):
        return path
    return os.path.join(REPO, path)


def command_line():
    """This script's command line as a results file shows it: the script's
    path relative to here, then its arguments."""
    return " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:])


def fresh_out(name):
    """A new directory under ./bench_out/ for one run's files, and the path
    prefix `name` inside it (the scripts write PREFIX.md, PREFIX.csv, ...):
    a plain run never overwrites earlier results."""
    os.makedirs("bench_out", exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    d = tempfile.mkdtemp(prefix=f"{name}-{stamp}-", dir="bench_out")
    return os.path.join(d, name)


class _RawDefaults(argparse.RawTextHelpFormatter,
                   argparse.ArgumentDefaultsHelpFormatter):
    pass


class _Parser(argparse.ArgumentParser):
    """Options given no help still show their default in --help."""

    def add_argument(self, *args, **kw):
        if kw.get("help") is None and kw.get("default") is not None:
            kw["help"] = "(default: %(default)s)"
        return super().add_argument(*args, **kw)


def parser(doc, raw=False):
    """An ArgumentParser whose --help shows every option's default (`raw`:
    the description printed as written)."""
    return _Parser(description=doc,
                   formatter_class=_RawDefaults if raw else
                   argparse.ArgumentDefaultsHelpFormatter)


def pyplot(script):
    """matplotlib's pyplot (Agg), or None after saying on stderr that the
    plot is skipped and how to get it."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        return plt
    except ImportError:
        print(f"{script}: matplotlib is not installed, so no plot "
              "(pip install matplotlib); the tables are written",
              file=sys.stderr)
        return None


def parse_runs(spec, script):
    """--runs and --policies: POLICY or POLICY@FRACTION, comma-separated,
    as [(policy, fraction or None)]; a bad item exits with one line."""
    runs = []
    for item in filter(None, spec.split(",")):
        policy, _, frac = item.partition("@")
        if not policy:
            sys.exit(f"{script}: {item!r}: no policy before the @")
        if frac:
            try:
                f = float(frac)
            except ValueError:
                sys.exit(f"{script}: bad fraction in {item!r}")
            if not 0 < f <= 1:
                sys.exit(f"{script}: {item!r}: the fraction must be in "
                         "(0, 1]")
            runs.append((policy, f))
        else:
            runs.append((policy, None))
    if not runs:
        sys.exit(f"{script}: no policy given")
    return runs


def policy_flags(policy, fraction):
    """The infinigen flags of one run: the policy, and at a fraction its
    target mean fetched fraction (--target_fetch)."""
    flags = [f"--policy={policy}"]
    if fraction is not None:
        flags.append(f"--target_fetch={fraction}")
    return flags


def free_port():
    """A TCP port on 127.0.0.1 free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
