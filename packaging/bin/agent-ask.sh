# Sourced by criu-action and gpusnap-hook: hand one step to gpusnap's agent of
# a CRIU run (gpusnap/action/agent.py: Python, the plan and the driver already
# loaded) instead of starting Python for it, and relay the agent's answer.
#
#   agent_ask DIR STEP INIT_PID ARG MARKER BOUND
#
# DIR: the agent's folder (<state>/actions/<criu pid>-agent); ARG: the request's
# last field; MARKER: the file where the agent's action.run_step writes the
# step's exit code once done ("" where there is none); BOUND: seconds to wait
# for the answer. What the agent printed goes to stderr. Returns
#   0  answered: AGENT_CODE is the step's exit code
#   1  no agent reads requests in DIR: nothing was asked
#   2  the agent (AGENT_PID) stopped before it answered: the step may be half done
#   3  no answer within BOUND seconds
# The agent's answer: what the step printed ("|" a line), then "=CODE".

# Running, not a zombie its new parent (a subreaper such as conmon) has not reaped.
agent_alive() {
  local stat
  { read -r stat < "/proc/$1/stat"; } 2>/dev/null || return 1
  stat=${stat##*) }
  [ "${stat%% *}" != Z ]
}

agent_ask() {
  local here=$1 step=$2 init=$3 arg=$4 marker=$5 bound=$6
  local spid= reply line part= done_since= asked code=
  AGENT_PID= AGENT_CODE=
  # started but not reading requests yet: wait while it lives (at most 10 s)
  { read -r spid < "$here/started"; } 2>/dev/null
  if [ -n "$spid" ] && [ ! -s "$here/pid" ]; then
    # by the clock: 1000 sleeps of 0.01 s took 11 s on an idle host (a fork each)
    local until=$(( ${EPOCHREALTIME//[!0-9]/} + 10000000 ))
    while (( ${EPOCHREALTIME//[!0-9]/} < until )); do
      { [ -s "$here/pid" ] || ! agent_alive "$spid"; } && break
      sleep 0.01
    done
  fi
  [ -p "$here/requests" ] && { read -r AGENT_PID < "$here/pid"; } 2>/dev/null
  { [ -n "$AGENT_PID" ] && agent_alive "$AGENT_PID"; } || return 1
  reply="$here/reply.$$"
  rm -f "$reply"
  # both ends opened read-write: neither open waits for the other side
  if ! { mkfifo -m 600 "$reply" 2>/dev/null && exec 3<>"$reply" 4<>"$here/requests"; }; then
    rm -f "$reply"
    return 1
  fi
  printf '%s %s %s %s\n' "$step" "$init" "$reply" "$arg" >&4
  exec 4>&-
  asked=$SECONDS
  while :; do
    if [ $((SECONDS - asked)) -ge "$bound" ]; then
      rm -f "$reply"; exec 3>&-
      return 3
    fi
    if IFS= read -r -t 0.5 line <&3; then
      line="$part$line" part=
      case "$line" in
        "|"*) printf '%s\n' "${line#|}" >&2 ;;
        "="*) rm -f "$reply"; exec 3>&-; AGENT_CODE=${line#=}; return 0 ;;
      esac
      continue
    fi
    part="$part$line"  # a read the timeout cut short keeps what it had read
    # The agent wrote the step's marker but no answer came within a round more:
    # the code stands, the printed lines are lost.
    if [ -n "$marker" ] && [ -s "$marker" ]; then
      if [ -n "$done_since" ]; then
        { read -r code < "$marker"; } 2>/dev/null  # no newline after it: read says 1
        AGENT_CODE=${code:-1}
        echo "gpusnap: $step: the agent's answer did not come; its step ended with code $AGENT_CODE" >&2
        rm -f "$reply"; exec 3>&-
        return 0
      fi
      done_since=1
    fi
    if ! agent_alive "$AGENT_PID"; then
      rm -f "$reply"; exec 3>&-
      # gone after its step was done: the marker's code, not a failure
      if [ -n "$marker" ] && [ -s "$marker" ]; then
        { read -r code < "$marker"; } 2>/dev/null
        AGENT_CODE=${code:-1}
        return 0
      fi
      return 2
    fi
  done
}
