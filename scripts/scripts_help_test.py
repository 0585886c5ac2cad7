"""The project's scripts as a user meets them: each answers --help with the
description at its head and exit status 0, and calls an unknown flag a usage
error (exit status 2) that points to --help, before doing anything else.

  scripts_help_test.py SCRIPT...
"""
import os
import subprocess
import sys
import tempfile
import unittest

SCRIPTS = [os.path.abspath(s) for s in sys.argv[1:]]


def head(script):
    """The first line of the comment under the shebang."""
    with open(script) as f:
        lines = f.read().splitlines()
    for line in lines[1:]:
        if line.startswith("#"):
            text = line.lstrip("#").strip()
            if text:
                return text
    return ""


def run(script, flag, cwd):
    return subprocess.run(["bash", script, flag], capture_output=True,
                          text=True, timeout=120, cwd=cwd)


class ScriptsHelp(unittest.TestCase):
    def setUp(self):
        self.assertTrue(SCRIPTS, "no scripts given")
        self.cwd = tempfile.mkdtemp(prefix="scripts_help_test.")

    def tearDown(self):
        os.rmdir(self.cwd)  # fails the test if a script wrote here

    def test_help_prints_the_scripts_description(self):
        for script in SCRIPTS:
            with self.subTest(script=os.path.basename(script)):
                r = run(script, "--help", self.cwd)
                self.assertEqual(r.returncode, 0, r.stderr)
                self.assertEqual(r.stdout.splitlines()[0].strip(),
                                 head(script), r.stdout)

    def test_an_unknown_flag_is_a_usage_error(self):
        for script in SCRIPTS:
            with self.subTest(script=os.path.basename(script)):
                r = run(script, "--no_such_flag", self.cwd)
                self.assertEqual(r.returncode, 2, r.stdout + r.stderr)
                self.assertIn("--help", r.stderr)
                self.assertEqual(r.stdout, "")


if __name__ == "__main__":
    unittest.main(argv=sys.argv[:1], verbosity=2)
