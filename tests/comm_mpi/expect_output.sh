#!/bin/sh
# expect_output.sh PATTERN... -- COMMAND...: runs COMMAND, shows its output, and passes
# when it exits 0 and every PATTERN (grep -E) matches some line of its stdout.
# (ctest's PASS_REGULAR_EXPRESSION alone would ignore the exit status.)
patterns=""
while [ "$#" -gt 0 ] && [ "$1" != "--" ]; do patterns="$patterns
$1"; shift; done
[ "$1" = "--" ] && shift
out=$(mktemp) || exit 2
"$@" > "$out"
rc=$?
cat "$out"
if [ "$rc" -ne 0 ]; then echo "expect_output: command exited $rc"; rm -f "$out"; exit 1; fi
echo "$patterns" | while IFS= read -r p; do
  [ -z "$p" ] && continue
  grep -Eq -- "$p" "$out" || { echo "expect_output: no line matches: $p"; exit 1; }
done
status=$?
rm -f "$out"
exit $status
