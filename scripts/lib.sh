# Shared by the project's scripts: make sure a Vulkan adapter exists (Mesa lavapipe, Vulkan on
# the CPU, when the machine has no GPU driver) and Mesa runs quietly.

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
    local sudo=""
    if [ "$(id -u)" != 0 ]; then
        command -v sudo >/dev/null || { echo "error: need root (or sudo) to apt-get install mesa-vulkan-drivers libvulkan1" >&2; return 1; }
        sudo="sudo"
    fi
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends mesa-vulkan-drivers libvulkan1 >/dev/null
    have_vulkan_icd || { echo "error: lavapipe installed but no Vulkan ICD is visible" >&2; return 1; }
}

quiet_mesa() {
    if [ -z "${XDG_RUNTIME_DIR:-}" ] || [ ! -d "${XDG_RUNTIME_DIR}" ]; then
        export XDG_RUNTIME_DIR="${TMPDIR:-/tmp}/expertkv-xdg-$(id -u)"
        mkdir -p -m 0700 "$XDG_RUNTIME_DIR"
    fi
}
