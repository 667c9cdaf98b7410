# Sourced by gpu.sh and tpu.sh once their output folder $R exists. With BUNDLE=1, on exit: the
# last lines of each log printed, then everything under $R packed into $R.tar.gz with
# steps.txt beside it as $R.steps.txt, and $R removed (the device tool returns at most eight
# files from $OUT: without this, a run of several steps loses some of them).
bundle() {
  local log
  for log in "$R"/*.log; do [ -f "$log" ] && { echo "== $(basename "$log")"; tail -n "${BUNDLE_TAIL:-15}" "$log"; }; done
  cp "$R/steps.txt" "$R.steps.txt" 2> /dev/null
  tar -czf "$R.tar.gz" -C "$(dirname "$R")" "$(basename "$R")" && rm -rf "$R"
}
[ "${BUNDLE:-0}" = 1 ] && trap bundle EXIT
