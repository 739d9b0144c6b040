#!/usr/bin/env bash
# 1P1D on one host: prefill on GPU FIRST_GPU, decode on the next one. See launch_xpyd.sh for the settings.
#   MODEL=/models/Llama-3.1-8B-Instruct examples/launch_1p1d.sh
exec env P=1 D=1 "$(dirname "$0")/launch_xpyd.sh" "$@"
