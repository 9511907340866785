#!/bin/sh
# What a device machine without package registries needs to run benchmarks/gpu.py, gathered
# here into .gpu/ (git-ignored; the device tool's `carry`): wheels for its Python (3.12) of
# every dependency, pip taking there only those its image lacks, and the default model's
# tokenizer, whose GGUF is too large to carry. Run from the repository root, with the .venv the
# README's commands make:
#
#     sh benchmarks/gpu_carry.sh
#
# then on the device machine (docs/gpu.md), with .gpu carried:
#
#     python3 -m pip install -q --no-index --find-links .gpu/wheels -e . &&
#     python3 benchmarks/gpu.py --tokenizer .gpu/tokenizer --skip ops --out $OUT/gpu.json
set -eu
PYTHON_VERSION=${PYTHON_VERSION:-3.12}
mkdir -p .gpu/wheels
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
# every manylinux tag pip must be told of by name (llguidance's wheels are manylinux_2_31)
platforms=""
for tag in manylinux1 manylinux2014 manylinux_2_17 manylinux_2_24 manylinux_2_27 \
           manylinux_2_28 manylinux_2_31 manylinux_2_34 manylinux_2_35; do
    platforms="$platforms --platform ${tag}_x86_64"
done
# the project's dependencies but torch (the machine's CUDA build stays), and its build backend
deps=$(.venv/bin/python -c 'import tomllib; print(" ".join(d for d in tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"] if not d.startswith("torch")))')
backend=$(.venv/bin/python -c 'import tomllib; print(" ".join(tomllib.load(open("pyproject.toml", "rb"))["build-system"]["requires"]))')
# shellcheck disable=SC2086
.venv/bin/python -m pip download -q --only-binary=:all: --python-version "$PYTHON_VERSION" \
    --implementation cp $platforms -d .gpu/wheels $deps $backend
# the device tool's list of the packages its image holds, where this workplace has it: their
# wheels stay behind (pip takes the installed ones there; what travels is limited to 64 MiB)
KINDS=${KINDS:-/work/.library/device/KINDS.md}
if [ -f "$KINDS" ]; then
    .venv/bin/python - "$KINDS" <<'PY'
import re, sys
from pathlib import Path
text = Path(sys.argv[1]).read_text()
norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()
have = {norm(n.strip().rstrip(".")) for n in text.split("Packages:", 1)[1].split("\n", 1)[0].split(",")}
for wheel in Path(".gpu/wheels").glob("*.whl"):
    if norm(wheel.name.split("-")[0]) in have and not wheel.name.startswith("setuptools"):
        wheel.unlink()
PY
fi
.venv/bin/python -c '
import sys; sys.path.insert(0, "tests")
from tiny_models import smollm2_tokenizer
smollm2_tokenizer().save_pretrained(".gpu/tokenizer")'
du -sh .gpu
