# Shared by the project's scripts: install Debian packages with clear errors, make sure a Vulkan
# adapter exists (Mesa lavapipe, Vulkan on the CPU, when the machine has no GPU driver) and Mesa
# runs quietly.

# with_timeout SECONDS CMD...: CMD, killed (exit 124) if it runs longer.
with_timeout() {
    local s=$1
    shift
    if command -v timeout >/dev/null; then
        timeout --kill-after=10 "$s" "$@"
    else
        "$@"
    fi
}

# root_cmd: nothing when root, else sudo (or an error when there is none).
root_cmd() {
    if [ "$(id -u)" = 0 ]; then
        return 0
    elif command -v sudo >/dev/null; then
        echo sudo
    else
        echo "error: root (or sudo) is needed to install packages" >&2
        return 1
    fi
}

# apt_install PKG...: apt-get update (once per script run) and install, quietly, each step under
# a time limit, with a message that names what failed.
apt_install() {
    command -v apt-get >/dev/null || {
        echo "error: apt-get not found; install $* by hand (this script knows Debian and Ubuntu)" >&2
        return 1
    }
    local sudo
    sudo=$(root_cmd) || return 1
    local opts=(-o Acquire::http::Timeout=30 -o Acquire::Retries=3 -o DPkg::Lock::Timeout=300)
    if [ -z "${EXPERTKV_APT_UPDATED:-}" ]; then
        with_timeout 300 $sudo apt-get "${opts[@]}" update -qq || {
            echo "error: apt-get update failed or timed out (is the Debian mirror reachable?)" >&2
            return 1
        }
        export EXPERTKV_APT_UPDATED=1
    fi
    with_timeout 900 $sudo env DEBIAN_FRONTEND=noninteractive apt-get "${opts[@]}" install -y -qq --no-install-recommends "$@" >/dev/null || {
        echo "error: apt-get install $* failed or timed out" >&2
        return 1
    }
}

have_vulkan_icd() {
    [ -n "${VK_DRIVER_FILES:-}${VK_ICD_FILENAMES:-}" ] && return 0
    local libs
    libs=$(ldconfig -p 2>/dev/null || true)
    case "$libs" in *libvulkan.so.1*) ;; *) return 1 ;; esac
    local f
    for f in /usr/share/vulkan/icd.d/*.json /etc/vulkan/icd.d/*.json /usr/local/share/vulkan/icd.d/*.json; do
        [ -e "$f" ] && return 0
    done
    return 1
}

ensure_gpu() {
    if have_vulkan_icd; then
        return 0
    fi
    echo "expertkv: no Vulkan driver found; installing Mesa lavapipe (Vulkan on the CPU)" >&2
    apt_install mesa-vulkan-drivers libvulkan1 || return 1
    have_vulkan_icd || { echo "error: lavapipe installed but no Vulkan ICD is visible" >&2; return 1; }
}

quiet_mesa() {
    if [ -z "${XDG_RUNTIME_DIR:-}" ] || [ ! -d "${XDG_RUNTIME_DIR}" ]; then
        export XDG_RUNTIME_DIR="${TMPDIR:-/tmp}/expertkv-xdg-$(id -u)"
        mkdir -p -m 0700 "$XDG_RUNTIME_DIR"
    fi
}

# need_cargo: rustup's cargo, or a message saying what to install.
need_cargo() {
    command -v cargo >/dev/null || {
        echo "error: cargo not found: install Rust $(sed -n 's/^rust-version = "\(.*\)"/\1/p' Cargo.toml) or newer (https://rustup.rs)" >&2
        return 1
    }
}
