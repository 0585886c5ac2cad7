"""Counts test cases from Bazel's test.xml files and its summary.

Usage: count_tests.py BAZEL_OUTPUT_LOG TESTLOGS_DIR [LOG TESTLOGS_DIR ...]

Prints `N passed, N failed, N skipped`, summed over every (log, testlogs)
pair: one per `bazel test` run (the plain run, then each sanitizer's,
whose test logs are in its own output directory). A test target that Bazel reports as
failed (or not built, timed out, flaky) but whose XML records no failing
case counts as one failure, so a crash or build break is never hidden.
"""
import os
import re
import sys
import xml.etree.ElementTree as ET


def count(log_path, testlogs):
    with open(log_path, errors="replace") as f:
        log = f.read()
    statuses = {}
    # "(cached)": a result Bazel did not rerun still counts.
    for m in re.finditer(r"^(//\S+)\s+(?:\(cached\)\s+)?"
                         r"(PASSED|FAILED TO BUILD|FAILED|"
                         r"TIMEOUT|NO STATUS|FLAKY|SKIPPED)", log, re.M):
        statuses[m.group(1)] = m.group(2)
    passed = failed = skipped = 0
    for target, status in sorted(statuses.items()):
        pkg, name = target[2:].split(":")
        xml_path = os.path.join(testlogs, pkg, name, "test.xml")
        t_pass = t_fail = t_skip = 0
        if status != "FAILED TO BUILD" and os.path.exists(xml_path):
            try:
                for case in ET.parse(xml_path).getroot().iter("testcase"):
                    if case.find("failure") is not None or \
                            case.find("error") is not None:
                        t_fail += 1
                    elif case.get("result") == "skipped" or \
                            case.find("skipped") is not None or \
                            case.get("status") == "notrun":
                        t_skip += 1
                    else:
                        t_pass += 1
            except ET.ParseError:
                pass
        if status == "SKIPPED" and t_pass + t_fail + t_skip == 0:
            t_skip = 1  # a check that could not run here, and said why
        elif status not in ("PASSED", "SKIPPED") and t_fail == 0:
            t_fail = 1
        elif status == "PASSED" and t_pass + t_skip == 0:
            t_pass = 1  # a check without test cases (fuzz/run.sh's smoke)
        passed += t_pass
        failed += t_fail
        skipped += t_skip
    if not statuses and "ERROR" in log:
        failed += 1  # the build broke before any test ran
    return passed, failed, skipped


def main():
    args = sys.argv[1:]
    if not args or len(args) % 2:
        sys.exit("usage: count_tests.py LOG TESTLOGS_DIR [LOG TESTLOGS_DIR ...]")
    totals = [0, 0, 0]
    for i in range(0, len(args), 2):
        for k, n in enumerate(count(args[i], args[i + 1])):
            totals[k] += n
    print(f"{totals[0]} passed, {totals[1]} failed, {totals[2]} skipped")


if __name__ == "__main__":
    main()
