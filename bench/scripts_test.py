#!/usr/bin/env python3
"""The bench/ scripts as a user meets them: each answers --help from any
directory (no import of what only a run needs), shows every option's
default, and by default writes to a fresh directory, never over earlier
results; plots are skipped with a word where matplotlib is missing.

Usage: scripts_test.py BENCH_DIR
"""
import glob
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

BENCH = os.path.abspath(sys.argv[1])
sys.path.insert(0, BENCH)
import benchutil  # noqa: E402

SCRIPTS = sorted(p for p in glob.glob(os.path.join(BENCH, "*.py"))
                 if os.path.basename(p) not in ("benchutil.py",
                                                "scripts_test.py"))


class Scripts(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="bench_scripts_")

    def tearDown(self):
        shutil.rmtree(self.dir, ignore_errors=True)

    def test_help_from_another_directory_shows_the_defaults(self):
        self.assertGreaterEqual(len(SCRIPTS), 9, SCRIPTS)
        for script in SCRIPTS:
            with self.subTest(script=os.path.basename(script)):
                r = subprocess.run([sys.executable, script, "--help"],
                                   cwd=self.dir, capture_output=True,
                                   text=True, timeout=60)
                self.assertEqual(r.returncode, 0, r.stderr)
                self.assertNotIn("Traceback", r.stderr)
                self.assertIn("usage:", r.stdout)
                self.assertIn("(default:", r.stdout)

    def test_paths_resolve_from_the_repository(self):
        os.chdir(self.dir)
        # Not here: the repository's.
        self.assertEqual(benchutil.repo_path("bench/benchutil.py"),
                         os.path.join(benchutil.REPO, "bench/benchutil.py"))
        self.assertTrue(os.path.exists(
            benchutil.repo_path("bench/benchutil.py")))
        # Here, or absolute: as given.
        open("mine.txt", "w").close()
        self.assertEqual(benchutil.repo_path("mine.txt"), "mine.txt")
        self.assertEqual(benchutil.repo_path("/abs/x"), "/abs/x")

    def test_each_run_gets_a_fresh_directory(self):
        os.chdir(self.dir)
        a = benchutil.fresh_out("accuracy")
        b = benchutil.fresh_out("accuracy")
        self.assertNotEqual(os.path.dirname(a), os.path.dirname(b))
        for p in (a, b):
            self.assertTrue(os.path.isdir(os.path.dirname(p)))
            self.assertEqual(os.path.basename(p), "accuracy")
            self.assertTrue(os.path.dirname(p).startswith("bench_out"))

    def test_plots_only_with_matplotlib(self):
        plt = benchutil.pyplot("scripts_test.py")
        try:
            import matplotlib  # noqa: F401
            self.assertIsNotNone(plt)
        except ImportError:
            self.assertIsNone(plt)


if __name__ == "__main__":
    unittest.main(argv=sys.argv[:1], verbosity=2)
