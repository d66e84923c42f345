# Sourced by tools/{dist,slurm}_{train,test}.sh: choose the CPU allocator of the
# processes they start, before any of them allocates.
#
# MMFSDP_CPU_ALLOCATOR:
#   auto (default)  jemalloc if its shared library is installed, else tcmalloc, else glibc
#   jemalloc        jemalloc; an error if it is not installed
#   tcmalloc        tcmalloc (or tcmalloc-minimal); an error if it is not installed
#   glibc           preload nothing (the opt-out)
# An LD_PRELOAD that already names jemalloc or tcmalloc is left as it is.
#
# Why: FSDP allocates and frees every gathered unit and unsharded gradient each
# step; glibc's heap keeps that memory resident and fragmented, so a rank's peak
# stays near DDP's. jemalloc and tcmalloc reuse it by size and give pages back.
# docs/benchmarks-archive.md (CPU allocator) has the measurements.
#
# Where: the folders torch's own CPU launcher searches
# (python -m torch.backends.xeon.run_cpu --enable-jemalloc), plus Debian's and
# Ubuntu's multiarch folder, then the dynamic linker's cache (ldconfig -p).
# Debian / Ubuntu: apt-get install libjemalloc2 (or libtcmalloc-minimal4).

_mmfsdp_find_lib() {  # NAME...: the first installed lib NAME.so[.N], or nothing
    local dirs=() dir name found
    [[ -n "${CONDA_PREFIX:-}" ]] && dirs+=("$CONDA_PREFIX/lib")
    [[ -n "${VIRTUAL_ENV:-}" ]] && dirs+=("$VIRTUAL_ENV/lib")
    dirs+=("$HOME/.local/lib" /usr/local/lib /usr/local/lib64 /usr/lib /usr/lib64
           "/usr/lib/$(uname -m)-linux-gnu" "/lib/$(uname -m)-linux-gnu")
    for name in "$@"; do
        for dir in "${dirs[@]}"; do
            for found in "$dir/lib$name.so" "$dir/lib$name.so".[0-9]*; do
                [[ -f "$found" ]] && { echo "$found"; return 0; }
            done
        done
        found=$(ldconfig -p 2>/dev/null | awk -v n="lib$name.so" \
            'index($1, n) == 1 && $NF ~ /^\// {print $NF; exit}')
        [[ -n "$found" ]] && { echo "$found"; return 0; }
    done
    return 0
}

_mmfsdp_preload_allocator() {
    local choice=${MMFSDP_CPU_ALLOCATOR:-auto} lib='' candidate
    if [[ "${LD_PRELOAD:-}" =~ (jemalloc|tcmalloc) ]]; then
        echo "mmfsdp: CPU allocator: ${BASH_REMATCH[1]} (LD_PRELOAD already names it)" >&2
        return 0
    fi
    case "$choice" in
        glibc)
            echo "mmfsdp: CPU allocator: glibc (MMFSDP_CPU_ALLOCATOR=glibc, nothing preloaded)" >&2
            return 0 ;;
        auto) candidate='jemalloc tcmalloc' ;;
        jemalloc|tcmalloc) candidate=$choice ;;
        *)
            echo "mmfsdp: MMFSDP_CPU_ALLOCATOR='$choice' is not one of: auto, jemalloc," \
                 "tcmalloc, glibc" >&2
            return 2 ;;
    esac
    for candidate in $candidate; do
        if [[ $candidate == tcmalloc ]]; then
            lib=$(_mmfsdp_find_lib tcmalloc tcmalloc_minimal)
        else
            lib=$(_mmfsdp_find_lib "$candidate")
        fi
        [[ -n "$lib" ]] && break
    done
    if [[ -z "$lib" ]]; then
        if [[ $choice != auto ]]; then
            echo "mmfsdp: MMFSDP_CPU_ALLOCATOR=$choice, but lib$choice.so is not installed" \
                 "(Debian / Ubuntu: apt-get install libjemalloc2 or libtcmalloc-minimal4)" >&2
            return 2
        fi
        echo "mmfsdp: CPU allocator: glibc (neither jemalloc nor tcmalloc is installed;" \
             "apt-get install libjemalloc2 lowers FSDP's peak on the CPU)" >&2
        return 0
    fi
    export LD_PRELOAD="$lib${LD_PRELOAD:+:$LD_PRELOAD}"
    echo "mmfsdp: CPU allocator: preloading $lib (MMFSDP_CPU_ALLOCATOR=glibc to opt out)" >&2
}

_mmfsdp_preload_allocator
