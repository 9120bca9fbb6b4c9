#!/bin/sh
# Installs Nemesis into a new virtual environment, as the Docker image runs it.
#
#   deploy/install.sh VENV [REQUIREMENT]
#
# VENV is created (it must not exist). REQUIREMENT is what pip installs: a path
# with extras, a wheel, or a "nemesis @ git+https://..." spec; the default is this
# checkout with the speed extra. PYTHON picks the interpreter (default python3).
#
# deploy/Dockerfile runs this script and tests/test_install.py runs it the way the
# Dockerfile does, so the image's install is the tested one.
set -eu

if [ "$#" -lt 1 ] || [ "$#" -gt 2 ]; then
    echo "usage: $0 VENV [REQUIREMENT]" >&2
    exit 2
fi
venv=$1
here=$(cd "$(dirname "$0")/.." && pwd)
requirement=${2:-"$here[speed]"}
python=${PYTHON:-python3}

if [ -e "$venv" ]; then
    echo "$0: $venv exists; give a new directory" >&2
    exit 2
fi

"$python" -m venv "$venv"
"$venv/bin/python" -m pip install --disable-pip-version-check "$requirement"
# The wheel's build compiled the gRPC contract (build_proto.py): fail here, not at the
# first gRPC delivery, if it is missing. -I: the installed package, not a checkout in
# the working directory.
"$venv/bin/python" -I -c "import nemesis.proto.nemesis.v1.handler_pb2"
"$venv/bin/nemesis" --version
