# Sourced by scripts/sanitize.sh and scripts/amx_emu.sh: a second build of the CPU extension that never
# touches the in-place one, and a copy of the package to import it from.
#
# side_build DIR: builds with the caller's KVKERNELS_* switches (setup.py) into DIR/temp and DIR/lib (log in
# DIR/build.log, its tail printed on failure), then lays DIR/pkg/kvkernels: the package with that _C and a
# link to metal/ (kvkernels.metal finds its sources next to the package). Tests run from DIR/pkg, so
# `import kvkernels` finds the copy first (subprocess workers such as the fuzzer's too); side_import_check
# DIR verifies it. Needs ROOT (the repository) and PY (its python).
side_build() {
  local dir=$1
  mkdir -p "$dir"
  MAX_JOBS=${MAX_JOBS:-2} "$PY" setup.py -q build_ext --build-temp "$dir/temp" --build-lib "$dir/lib" \
    >"$dir/build.log" 2>&1 || { tail -50 "$dir/build.log"; return 1; }
  rm -rf "$dir/pkg"
  mkdir -p "$dir/pkg"
  cp -r kvkernels "$dir/pkg/kvkernels"
  find "$dir/pkg" \( -name '__pycache__' -o -name '_C*.so' -o -name '.built' \) -prune -exec rm -rf {} +
  cp "$dir"/lib/kvkernels/_C*.so "$dir/pkg/kvkernels/"
  ln -s "$ROOT/metal" "$dir/pkg/metal"
}

# side_import_check DIR: run from DIR/pkg; fails unless `import kvkernels` loads DIR/pkg's copy.
side_import_check() {
  local where
  where=$("$PY" -c "import kvkernels, os; print(os.path.dirname(kvkernels._C.__file__))")
  [ "$where" = "$ROOT/$1/pkg/kvkernels" ] || { echo "$0: imported kvkernels from $where" >&2; return 1; }
}
