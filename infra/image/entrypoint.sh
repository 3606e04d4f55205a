#!/bin/sh
# The service image's entry point: the first argument picks what runs.
#   ingress | state | memory | router | dispatch | judge | gateway   -> python -m mars_<service>
#   mars ARGS...                                           -> the MARS CLI (e.g. `mars migrate`)
#   anything else                                          -> run as given (the venv's bin is on PATH)
set -e
case "${1:-help}" in
    ingress | state | memory | router | dispatch | judge | gateway)
        service="$1"
        shift
        exec python -m "mars_${service}" "$@"
        ;;
    help | -h | --help)
        echo "usage: IMAGE {ingress|state|memory|router|dispatch|judge|gateway}  |  IMAGE mars ARGS...  |  IMAGE CMD..." >&2
        exit 64
        ;;
    *)
        exec "$@"
        ;;
esac
