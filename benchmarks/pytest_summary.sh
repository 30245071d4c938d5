# Sourced by gpu_session.sh and ab_trees.sh (bash).
#
# summarize_tests LOG: what a pytest log says, in a few lines for a session's log and output (a device call returns
# only a few files): its FAILED / ERROR lines, then its summary line or, where the call's limit stopped the run
# (faulthandler's dump), the count of each outcome so far and the frames it was in.
summarize_tests() {
  grep -E '^(FAILED|ERROR) ' "$1"
  if grep -q 'Fatal Python error' "$1"; then
    echo "stopped by the limit after: $(sed -n '1,/Fatal Python error/p' "$1" | sed 's/Fatal Python error.*//' |
      grep -E '^[.sFEx]*( *\[ *[0-9]+%\])?$' | tr -cd '.sFEx' | fold -w1 | sort | uniq -c |
      awk 'BEGIN { n["."] = "passed"; n["s"] = "skipped"; n["F"] = "failed"; n["E"] = "errors"; n["x"] = "xfailed" }
           { printf "%s%d %s", (NR > 1 ? ", " : ""), $1, n[$2] }')"
    sed -n '/^Current thread/,/^$/p' "$1" | grep 'File "' | grep -v '/site-packages/' |
      awk 'NR == 1 || (/\/tests\// && !seen++)'  # the innermost frame and the first test frame
  else
    tail -n 1 "$1"
  fi
}
