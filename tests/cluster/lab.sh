#!/usr/bin/env bash
# A two-node Slurm + SSH lab on one Linux machine, built from network namespaces.
#
#   tests/cluster/lab.sh up | down | status | run-srun-check | run-ssh-check | run-net-check
#   tests/cluster/lab.sh cut n2 | heal n2        # simulate losing / regaining a node
#   tests/cluster/lab.sh ps [--ours]             # processes in the node namespaces (--ours: dist_kernel only)
#
# Layout (see tests/cluster/README.md):
#   root netns : bridge $LAB_BR 10.77.0.1/24, munged, slurmctld (own UTS ns, hostname "ctl")
#   netns n1   : iface lab0 10.77.0.11, slurmd (hostname n1), sshd on 10.77.0.11:22
#   netns n2   : iface lab0 10.77.0.12, slurmd (hostname n2), sshd on 10.77.0.12:22
# Everything the lab owns (configs, keys, pids, logs) lives in $LAB_DIR (0711; keys in 0700 subdirs).
# Tests source "$LAB_DIR/env.sh" after `up`.
#
# Exit codes: 0 ok; 77 = the lab cannot be built here (reason on one line, prefixed
# "SKIP:"); 1 = it should have worked but did not (logs are printed).
set -u -o pipefail

LAB_DIR=${LAB_DIR:-/run/dk-cluster-lab}
LAB_NET=${LAB_NET:-10.77.0}            # /24; .1 is the root namespace, .11/.12 the nodes
LAB_BR=${LAB_BR:-dklab0}
LAB_IF=lab0                            # interface name inside every node namespace
NODES=(n1 n2)
HOSTS_TAG="# dk-cluster-lab"
REPO=$(cd "$(dirname "$(readlink -f "$0")")/../.." && pwd)
PY=${LAB_PYTHON:-$REPO/.venv/bin/python}   # this checkout's venv (CI may clone anywhere)
CPUS_PER_NODE=${LAB_CPUS:-4}           # > real cores is fine: SlurmdParameters=config_overrides

die()  { echo "lab: $*" >&2; exit 1; }
skip() { echo "SKIP: $*"; exit 77; }
log()  { echo "lab: $*" >&2; }
node_ip() { case $1 in n1) echo "$LAB_NET.11";; n2) echo "$LAB_NET.12";; esac; }
node_idx() { echo "${1#n}"; }

# ---------------------------------------------------------------- pid bookkeeping
# $LAB_DIR/pids/<name> holds "<pid> <starttime>"; we only ever signal a pid whose
# /proc starttime still matches, so a recycled pid is never hit.
starttime() { awk '{print $22}' "/proc/$1/stat" 2>/dev/null; }
# running = exists and is not a zombie (our daemons are reparented to pid 1, which here
# reaps slowly, so an exited daemon can linger as <defunct> for seconds)
running() { [[ -r /proc/$1/stat ]] && [[ $(awk '{print $3}' "/proc/$1/stat" 2>/dev/null) != Z ]]; }
record_pid() { echo "$2 $(starttime "$2")" > "$LAB_DIR/pids/$1"; }
alive() {  # alive <name> -> prints pid if the recorded process still runs
  local f="$LAB_DIR/pids/$1" pid st
  [[ -f $f ]] || return 1
  read -r pid st < "$f"
  [[ -n ${pid:-} ]] && running "$pid" && [[ "$(starttime "$pid")" == "$st" ]] || return 1
  echo "$pid"
}
stop_pid() {  # stop_pid <name>: TERM, wait up to 5 s, KILL
  local pid i
  pid=$(alive "$1") || { rm -f "$LAB_DIR/pids/$1"; return 0; }
  kill -TERM "$pid" 2>/dev/null
  for i in $(seq 50); do running "$pid" || break; sleep 0.1; done
  running "$pid" && kill -KILL "$pid" 2>/dev/null
  rm -f "$LAB_DIR/pids/$1"
}

# ---------------------------------------------------------------- preflight
preflight() {
  [[ $(id -u) == 0 ]] || skip "lab.sh up needs root (uid $(id -u))"
  command -v ip >/dev/null || skip "iproute2 (ip) missing"
  command -v unshare >/dev/null || skip "unshare (util-linux) missing"
  unshare --uts true 2>/dev/null || skip "cannot unshare a UTS namespace (no CAP_SYS_ADMIN / seccomp)"
  unshare --net true 2>/dev/null || skip "cannot unshare a network namespace (no CAP_SYS_ADMIN)"
  if ! ip link show "$LAB_BR" >/dev/null 2>&1; then
    ip link add dklabprobe0 type bridge 2>/dev/null || skip "cannot create a bridge (no CAP_NET_ADMIN or no bridge module)"
    ip link del dklabprobe0
  fi
  local missing=()
  for b in munged slurmctld slurmd srun sshd; do
    command -v $b >/dev/null || [[ -x /usr/sbin/$b ]] || missing+=("$b")
  done
  if ((${#missing[@]})); then
    log "installing munge slurmctld slurmd slurm-client openssh-server (missing: ${missing[*]})"
    command -v apt-get >/dev/null || skip "missing ${missing[*]} and no apt-get"
    export DEBIAN_FRONTEND=noninteractive
    { apt-get install -y -q --no-install-recommends munge slurmctld slurmd slurm-client openssh-server \
      || { apt-get update -q && apt-get install -y -q --no-install-recommends munge slurmctld slurmd slurm-client openssh-server; }; } \
      > "/tmp/dk-cluster-lab-apt.log" 2>&1 || skip "apt-get install of munge/slurm/openssh-server failed (see /tmp/dk-cluster-lab-apt.log)"
  fi
  id munge >/dev/null 2>&1 || skip "user 'munge' missing after install"
}

# ---------------------------------------------------------------- config files
write_configs() {
  mkdir -p "$LAB_DIR"/{pids,log,state,spool/n1,spool/n2,munge,ssh}
  chmod 0711 "$LAB_DIR"   # munged (user munge) must traverse it; secrets sit in 0700 subdirs
  # munge: a private key + socket, so the lab never touches a system munged
  chown munge:munge "$LAB_DIR/munge"; chmod 0700 "$LAB_DIR/munge"
  if [[ ! -s $LAB_DIR/munge/munge.key ]]; then
    dd if=/dev/urandom of="$LAB_DIR/munge/munge.key" bs=1024 count=1 status=none
    chown munge:munge "$LAB_DIR/munge/munge.key"; chmod 0600 "$LAB_DIR/munge/munge.key"
  fi
  cat > "$LAB_DIR/slurm.conf" <<EOF
# generated by tests/cluster/lab.sh
ClusterName=dklab
SlurmctldHost=ctl($LAB_NET.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$LAB_DIR/munge/munge.socket
StateSaveLocation=$LAB_DIR/state
SlurmdSpoolDir=$LAB_DIR/spool/%n
SlurmctldPidFile=$LAB_DIR/slurmctld.pid
SlurmdPidFile=$LAB_DIR/slurmd-%n.pid
SlurmctldLogFile=$LAB_DIR/log/slurmctld.log
SlurmdLogFile=$LAB_DIR/log/slurmd-%n.log
SlurmctldPort=16817
SlurmdPort=16818
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
SchedulerType=sched/builtin
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
# short timers so cancellation / node loss show up within seconds in tests
KillWait=3
SlurmdTimeout=15
MessageTimeout=5
InactiveLimit=0
MinJobAge=5
NodeName=n1 NodeAddr=$LAB_NET.11 CPUs=$CPUS_PER_NODE RealMemory=1000 State=UNKNOWN
NodeName=n2 NodeAddr=$LAB_NET.12 CPUs=$CPUS_PER_NODE RealMemory=1000 State=UNKNOWN
PartitionName=all Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP
MailProg=/bin/true
EOF
  # no systemd / no cgroup delegation here: without this slurmd dies with
  # "No filesystem mounted on /sys/fs/cgroup" (v1 hosts) or cgroup/v2 dbus errors.
  if [[ -f /sys/fs/cgroup/cgroup.controllers ]]; then
    printf 'CgroupPlugin=cgroup/v2\nCgroupAutomount=no\nIgnoreSystemd=yes\n' > "$LAB_DIR/cgroup.conf"
  else
    printf 'CgroupPlugin=cgroup/v1\nCgroupAutomount=no\n' > "$LAB_DIR/cgroup.conf"
  fi

  # ssh: lab-only host key and client key (never in the repo)
  local s=$LAB_DIR/ssh
  chmod 0700 "$s"
  [[ -s $s/host_ed25519 ]] || ssh-keygen -q -t ed25519 -N '' -C dk-cluster-lab-host -f "$s/host_ed25519"
  [[ -s $s/id_ed25519 ]]   || ssh-keygen -q -t ed25519 -N '' -C dk-cluster-lab-client -f "$s/id_ed25519"
  chmod 0600 "$s/host_ed25519" "$s/id_ed25519"
  cp "$s/id_ed25519.pub" "$s/authorized_keys"; chmod 0600 "$s/authorized_keys"
  echo "$LAB_NET.11,$LAB_NET.12,n1,n2 $(cut -d' ' -f1,2 "$s/host_ed25519.pub")" > "$s/known_hosts"
  chmod 0600 "$s/known_hosts"
  for n in "${NODES[@]}"; do
    cat > "$s/sshd_config-$n" <<EOF
# generated by tests/cluster/lab.sh
ListenAddress $(node_ip "$n"):22
HostKey $s/host_ed25519
PidFile $LAB_DIR/sshd-$n.pid
AuthorizedKeysFile $s/authorized_keys
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes yes
X11Forwarding no
PrintMotd no
AcceptEnv DK_* LAB_*
# notice a vanished client (node loss) within ~10 s and end its session
ClientAliveInterval 5
ClientAliveCountMax 2
Subsystem sftp internal-sftp
EOF
  done
  : > "$s/ssh_config"  # empty: `ssh -F` this so ~/.ssh/config and /etc/ssh/ssh_config are ignored

  local sshopts="-F $s/ssh_config -i $s/id_ed25519 -o IdentitiesOnly=yes -o BatchMode=yes -o UserKnownHostsFile=$s/known_hosts -o GlobalKnownHostsFile=/dev/null -o StrictHostKeyChecking=yes -o ConnectTimeout=5 -o ServerAliveInterval=5 -o ServerAliveCountMax=2 -l root"
  cat > "$LAB_DIR/env.sh" <<EOF
# generated by tests/cluster/lab.sh up -- source me
export LAB_DIR=$LAB_DIR
export SLURM_CONF=$LAB_DIR/slurm.conf
export LAB_NODES="n1 n2"
export LAB_NODE_ADDRS="$LAB_NET.11 $LAB_NET.12"
export LAB_HEAD_ADDR=$LAB_NET.1          # the root namespace (parent kernel / rendezvous)
export LAB_NODE_IFNAME=$LAB_IF            # use as GLOO_SOCKET_IFNAME inside a node
export LAB_HEAD_IFNAME=$LAB_BR            # use as GLOO_SOCKET_IFNAME in the root namespace
export LAB_PYTHON=$PY
export LAB_SSH_KEY=$s/id_ed25519
export LAB_SSH_KNOWN_HOSTS=$s/known_hosts
export LAB_SSH_OPTS="$sshopts"
# usage: ssh \$LAB_SSH_OPTS $LAB_NET.11 hostname
EOF
}

# ---------------------------------------------------------------- network
net_up() {
  if ! ip link show "$LAB_BR" >/dev/null 2>&1; then
    ip link add "$LAB_BR" type bridge || die "bridge"
    ip addr add "$LAB_NET.1/24" dev "$LAB_BR"
  fi
  ip link set "$LAB_BR" up
  for n in "${NODES[@]}"; do
    local i; i=$(node_idx "$n")
    ip netns list | grep -qw "^$n" || ip netns add "$n" || die "netns add $n"
    if ! ip link show "dklabh$i" >/dev/null 2>&1; then
      ip link add "dklabh$i" type veth peer name "$LAB_IF" netns "$n" || die "veth $n"
    fi
    ip link set "dklabh$i" master "$LAB_BR"; ip link set "dklabh$i" up
    ip -n "$n" addr replace "$(node_ip "$n")/24" dev "$LAB_IF"
    ip -n "$n" link set "$LAB_IF" up
    ip -n "$n" link set lo up
  done
  if ! grep -q "$HOSTS_TAG" /etc/hosts; then
    # write in place (not sed -i): /etc/hosts is often a bind mount
    printf '%s\n' "$LAB_NET.1 ctl $HOSTS_TAG" "$LAB_NET.11 n1 $HOSTS_TAG" "$LAB_NET.12 n2 $HOSTS_TAG" >> /etc/hosts
  fi
}

net_down() {
  for n in "${NODES[@]}"; do
    ip link del "dklabh$(node_idx "$n")" 2>/dev/null
    ip netns del "$n" 2>/dev/null
  done
  ip link del "$LAB_BR" 2>/dev/null
  if grep -q "$HOSTS_TAG" /etc/hosts; then
    local tmp; tmp=$(grep -v "$HOSTS_TAG" /etc/hosts)
    printf '%s\n' "$tmp" > /etc/hosts
  fi
  return 0
}

# ---------------------------------------------------------------- daemons
wait_file() { local i; for i in $(seq 100); do [[ -e $1 ]] && return 0; sleep 0.1; done; return 1; }

start_daemons() {
  local s=$LAB_DIR/ssh
  if ! alive munged >/dev/null; then
    rm -f "$LAB_DIR/munge/munge.socket"*
    setsid setpriv --reuid=munge --regid=munge --init-groups /usr/sbin/munged -F --force \
      --socket="$LAB_DIR/munge/munge.socket" --key-file="$LAB_DIR/munge/munge.key" \
      --pid-file="$LAB_DIR/munge/munged.pid" --log-file="$LAB_DIR/munge/munged.log" \
      --seed-file="$LAB_DIR/munge/munged.seed" </dev/null >>"$LAB_DIR/log/munged.out" 2>&1 &
    wait_file "$LAB_DIR/munge/munged.pid" || { cat "$LAB_DIR/log/munged.out" "$LAB_DIR/munge/munged.log"; die "munged did not start"; }
    record_pid munged "$(cat "$LAB_DIR/munge/munged.pid")"
  fi
  if ! alive slurmctld >/dev/null; then
    # slurmctld refuses to run unless hostname == SlurmctldHost: own UTS namespace
    setsid unshare --uts sh -c "hostname ctl; exec /usr/sbin/slurmctld -D -i -f '$LAB_DIR/slurm.conf'" \
      </dev/null >>"$LAB_DIR/log/slurmctld.out" 2>&1 &
    record_pid slurmctld $!
  fi
  for n in "${NODES[@]}"; do
    if ! alive "slurmd-$n" >/dev/null; then
      setsid ip netns exec "$n" unshare --uts sh -c "hostname $n; exec /usr/sbin/slurmd -D -N $n -f '$LAB_DIR/slurm.conf'" \
        </dev/null >>"$LAB_DIR/log/slurmd-$n.out" 2>&1 &
      record_pid "slurmd-$n" $!
    fi
    if ! alive "sshd-$n" >/dev/null; then
      mkdir -p /run/sshd && chmod 0755 /run/sshd   # privilege separation dir (Debian)
      setsid ip netns exec "$n" unshare --uts sh -c "hostname $n; exec /usr/sbin/sshd -D -e -f '$s/sshd_config-$n'" \
        </dev/null >>"$LAB_DIR/log/sshd-$n.log" 2>&1 &
      record_pid "sshd-$n" $!
    fi
  done
}

wait_ready() {
  export SLURM_CONF=$LAB_DIR/slurm.conf
  local i out
  for i in $(seq 60); do
    out=$(sinfo -h -N -o '%N %t' 2>/dev/null | sort -u)
    if [[ $(grep -cE '^n[12] idle' <<<"$out") == 2 ]]; then break; fi
    sleep 0.5
  done
  if [[ $(grep -cE '^n[12] idle' <<<"$out") != 2 ]]; then
    # nodes left DOWN by an earlier run come back with ReturnToService=2 once slurmd
    # registers, but a DRAIN set by hand needs a resume
    scontrol update nodename=n1,n2 state=resume >/dev/null 2>&1
    sleep 2; out=$(sinfo -h -N -o '%N %t' 2>/dev/null | sort -u)
  fi
  [[ $(grep -cE '^n[12] idle' <<<"$out") == 2 ]] || {
    echo "sinfo: $out" >&2; tail -n 20 "$LAB_DIR"/log/*.log "$LAB_DIR"/log/*.out >&2; die "slurm nodes not idle"; }
  for n in "${NODES[@]}"; do
    for i in $(seq 50); do
      (exec 3<>/dev/tcp/"$(node_ip "$n")"/22) 2>/dev/null && break; sleep 0.1
    done
  done
  # shellcheck disable=SC1091
  . "$LAB_DIR/env.sh"
  for n in "${NODES[@]}"; do
    # shellcheck disable=SC2086
    [[ $(ssh $LAB_SSH_OPTS "$(node_ip "$n")" hostname 2>>"$LAB_DIR/log/ssh-client.log") == "$n" ]] \
      || { tail -n 20 "$LAB_DIR/log/sshd-$n.log" "$LAB_DIR/log/ssh-client.log" >&2; die "ssh to $n failed"; }
  done
}

cmd_up() {
  local t0=$SECONDS ns
  preflight
  write_configs
  net_up
  start_daemons
  wait_ready
  # remember the controller's private UTS namespace for the sweep in `down`
  local cpid; cpid=$(alive slurmctld) && ns=$(readlink "/proc/$cpid/ns/uts") \
    && [[ $ns != "$(readlink /proc/self/ns/uts)" && $ns != "$(readlink /proc/1/ns/uts)" ]] \
    && echo "$ns" > "$LAB_DIR/pids/ctl-uts-ns"
  echo "lab up in $((SECONDS - t0)) s; source $LAB_DIR/env.sh"
}

cmd_down() {
  [[ $(id -u) == 0 ]] || skip "lab.sh down needs root"
  if [[ -d $LAB_DIR/pids ]]; then
    for n in "${NODES[@]}"; do stop_pid "sshd-$n"; stop_pid "slurmd-$n"; done
    stop_pid slurmctld
    stop_pid munged
  fi
  # anything still in the controller's private UTS namespace is the lab's (slurmscriptd)
  if [[ -s $LAB_DIR/pids/ctl-uts-ns ]]; then
    local ns p; ns=$(cat "$LAB_DIR/pids/ctl-uts-ns")
    [[ $ns == "$(readlink /proc/self/ns/uts)" || $ns == "$(readlink /proc/1/ns/uts)" ]] && ns=never
    for p in /proc/[0-9]*; do [[ $(readlink "$p/ns/uts" 2>/dev/null) == "$ns" ]] && kill -KILL "${p#/proc/}" 2>/dev/null; done
  fi
  # anything still inside a node namespace is the lab's (job steps, ssh sessions)
  for n in "${NODES[@]}"; do
    local pids
    pids=$(ip netns pids "$n" 2>/dev/null | tr '\n' ' ')
    [[ -n ${pids// } ]] && kill -KILL $pids 2>/dev/null
  done
  sleep 0.2
  for n in "${NODES[@]}"; do
    local left; left=$(ip netns pids "$n" 2>/dev/null | tr '\n' ' ')
    [[ -n ${left// } ]] && log "warning: still in $n: $left"
  done
  net_down
  rm -rf "$LAB_DIR"
  echo "lab down"
}

cmd_status() {
  [[ -f $LAB_DIR/env.sh ]] || { echo "lab not up ($LAB_DIR/env.sh missing)"; return 3; }
  . "$LAB_DIR/env.sh"
  echo "== namespaces"; ip netns list
  echo "== bridge"; ip -br addr show "$LAB_BR" 2>&1
  for n in "${NODES[@]}"; do echo "== $n: $(ip -n "$n" -br addr show "$LAB_IF" 2>&1)  pids: $(ip netns pids "$n" 2>/dev/null | tr '\n' ' ')"; done
  echo "== daemons"
  for f in "$LAB_DIR"/pids/*; do
    [[ $f == */ctl-uts-ns ]] && continue
    local name pid; name=$(basename "$f")
    if pid=$(alive "$name"); then echo "$name pid=$pid running"; else echo "$name DEAD"; fi
  done
  echo "== sinfo"; sinfo -N -l 2>&1
}

# ---------------------------------------------------------------- checks
cmd_srun_check() {
  . "$LAB_DIR/env.sh" || die "lab not up"
  local rc=0
  echo "== srun -N2 -n4 --ntasks-per-node=2"
  srun -N2 -n4 --ntasks-per-node=2 -l bash -c \
    'echo host=$(hostname) PROCID=$SLURM_PROCID LOCALID=$SLURM_LOCALID NODEID=$SLURM_NODEID NODELIST=$SLURM_JOB_NODELIST NTASKS=$SLURM_NTASKS' \
    | sort || rc=1

  echo "== tasks on both nodes reach a TCP listener on $LAB_HEAD_ADDR (root namespace)"
  local port=47123
  "$LAB_PYTHON" - "$LAB_HEAD_ADDR" $port 4 > "$LAB_DIR/log/listener.out" 2>&1 <<'EOF' &
import socket, sys
host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((host, port)); s.listen(8); s.settimeout(30)
seen = []
for _ in range(n):
    c, addr = s.accept(); seen.append((c.recv(100).decode(), addr[0])); c.sendall(b"ok"); c.close()
for msg, ip in sorted(seen): print("listener got", msg, "from", ip)
EOF
  local lpid=$!
  sleep 1
  srun -N2 -n4 --ntasks-per-node=2 "$LAB_PYTHON" -c "
import os, socket, torch
s = socket.create_connection(('$LAB_HEAD_ADDR', $port), timeout=10)
s.sendall(('rank%s@%s' % (os.environ['SLURM_PROCID'], socket.gethostname())).encode())
print('task', os.environ['SLURM_PROCID'], socket.gethostname(), 'torch', torch.__version__, 'reply', s.recv(10).decode())
" | sort || rc=1
  wait $lpid || rc=1
  cat "$LAB_DIR/log/listener.out"

  echo "== sbatch + scancel leave nothing on the nodes"
  local jid
  jid=$(sbatch --parsable -N2 --ntasks-per-node=1 -o "$LAB_DIR/log/job-%j.out" --wrap 'srun sleep 300') || rc=1
  for _ in $(seq 40); do [[ $(squeue -h -j "$jid" -o %T) == RUNNING ]] && break; sleep 0.25; done
  sleep 2
  echo "job $jid: $(squeue -h -j "$jid" -o '%T %N')"
  for n in n1 n2; do echo "  $n before scancel: $(ns_cmds "$n" | grep -vE '^(/usr/sbin/slurmd|sshd)' | grep -v '^$' | sed 's/ *$//' | paste -sd'|')"; done
  scancel "$jid"
  gone_check || rc=1

  echo "== salloc + srun, then scancel"
  salloc -N2 --no-shell -J dklab-salloc >/dev/null 2>"$LAB_DIR/log/salloc.err" || true
  jid=$(squeue -h -n dklab-salloc -o %i | head -1)
  echo "salloc job $jid: $(squeue -h -j "$jid" -o '%T %N')"
  srun --jobid="$jid" -N2 --ntasks-per-node=1 sleep 300 > /dev/null 2>&1 &
  local spid=$!
  for _ in $(seq 40); do [[ $(count_sleep n2) -ge 1 ]] && break; sleep 0.25; done
  for n in n1 n2; do echo "  $n before scancel: $(ns_cmds "$n" | grep -vE '^(/usr/sbin/slurmd|sshd)' | grep -v '^$' | sed 's/ *$//' | paste -sd'|')"; done
  scancel "$jid"
  wait $spid; echo "  srun exit code after scancel: $?"
  gone_check || rc=1
  return $rc
}

count_sleep() { ns_cmds "$1" | grep -cE '(^|/)sleep 300'; }
ns_cmds() { local p; for p in $(ip netns pids "$1"); do { tr '\0' ' ' < "/proc/$p/cmdline"; } 2>/dev/null; echo; done; }
gone_check() {  # every node namespace holds only slurmd + sshd within 15 s of scancel
  local t0 left; t0=$(date +%s%N)
  while :; do
    left=$(for n in n1 n2; do ns_cmds $n | grep -vE '^(/usr/sbin/slurmd|sshd|/usr/sbin/sshd)' | sed "s/^/$n: /"; done | grep -v ': $')
    [[ -z $left ]] && { echo "  after scancel: no job process on n1/n2 (checked $(( ($(date +%s%N) - t0) / 1000000 )) ms after scancel returned)"; return 0; }
    (( $(date +%s%N) - t0 > 15000000000 )) && { echo "  LEFT BEHIND: $left"; return 1; }
    sleep 0.25
  done
}

cmd_ssh_check() {
  . "$LAB_DIR/env.sh" || die "lab not up"
  local rc=0 n ip
  for n in n1 n2; do
    ip=$(node_ip $n)
    echo "== ssh $ip"
    # shellcheck disable=SC2086
    ssh $LAB_SSH_OPTS "$ip" "hostname; $LAB_PYTHON -c 'import socket, torch; print(socket.gethostname(), torch.__version__)'" || rc=1
  done
  echo "== env over ssh (SendEnv DK_*) and secret over stdin"
  DK_TOKEN=from-sendenv ssh $LAB_SSH_OPTS -o SendEnv=DK_TOKEN "$LAB_NET.11" 'echo DK_TOKEN=$DK_TOKEN; read -r s; echo stdin-secret-len=${#s}' <<< "s3cr3t-value" || rc=1

  echo "== does killing the ssh client end the remote command?"
  ssh_kill_case "plain ssh"          ""     "sleep 300" || true
  ssh_kill_case "ssh -tt"            "-tt"  "sleep 300" || rc=1
  ssh_kill_case "stdin-EOF wrapper"  ""     'sleep 300 & p=$!; cat >/dev/null; kill $p' || rc=1
  return $rc
}

ssh_kill_case() {  # ssh_kill_case <label> <extra ssh opts> <remote cmd>
  local label=$1 extra=$2 cmd=$3 n=n2 ip spid i before after
  ip=$(node_ip $n)
  # stdin must be something that stays open but is not our terminal: a fifo-ish sleep pipe
  # shellcheck disable=SC2086
  ( sleep 600 | ssh $LAB_SSH_OPTS $extra "$ip" "$cmd" >/dev/null 2>&1 ) &
  local sub=$!
  for i in $(seq 40); do [[ $(count_sleep $n) -ge 1 ]] && break; sleep 0.25; done
  before=$(count_sleep $n)
  spid=$(pgrep -P "$sub" -x ssh || true)
  [[ -n $spid ]] && kill -KILL "$spid"
  pkill_children "$sub"
  sleep 2
  after=$(count_sleep $n)
  echo "  $label: remote 'sleep 300' before kill=$before, 2 s after SIGKILL of ssh client=$after -> $([[ $after == 0 ]] && echo 'DIES' || echo 'SURVIVES')"
  # clean up survivors (they are in the lab namespace, i.e. ours)
  for p in $(ip netns pids $n); do grep -qE '(^|/)sleep 300' <(tr '\0' ' ' < /proc/$p/cmdline) && kill -KILL "$p"; done
  [[ $after == 0 ]]
}
pkill_children() {  # kill the helper subshell's other children (the stdin sleep) by pid
  local c; for c in $(pgrep -P "$1"); do kill -KILL "$c" 2>/dev/null; done; kill -KILL "$1" 2>/dev/null; wait "$1" 2>/dev/null; return 0
}

in_node() {  # in_node <n> <cmd...>: run like a process on node <n> (its netns + hostname)
  local n=$1; shift
  ip netns exec "$n" unshare --uts sh -c 'hostname "$0"; exec "$@"' "$n" "$@"
}

cmd_net_check() {
  . "$LAB_DIR/env.sh" || die "lab not up"
  local rc=0 here port
  here=$(dirname "$(readlink -f "$0")")
  echo "== reachability from n1 (TCP connect; ICMP with ping if present)"
  for dst in "$LAB_HEAD_ADDR:16817 (slurmctld, root ns)" "$LAB_NET.12:22 (sshd n2)" "$LAB_NET.11:22 (own sshd)"; do
    local hp=${dst%% *}
    if in_node n1 bash -c "exec 3<>/dev/tcp/${hp%:*}/${hp#*:}" 2>/dev/null; then echo "  n1 -> $dst: TCP ok"; else echo "  n1 -> $dst: TCP FAIL"; rc=1; fi
  done
  if command -v ping >/dev/null; then
    for ip in "$LAB_HEAD_ADDR" "$LAB_NET.12"; do in_node n1 ping -c1 -W2 "$ip" | grep -E 'packets|rtt' | sed "s/^/  ping $ip: /"; done
  fi
  echo "== n1 -> 1.1.1.1 must be unreachable (lab has no route out):"
  in_node n1 ip route get 1.1.1.1 >/dev/null 2>&1 && { echo "  n1 has a route out!"; rc=1; } || echo "  no route: ok"

  gloo_case() {  # gloo_case <label> <env for n1/n2 ranks>
    port=$((29000 + RANDOM % 1000))
    "$LAB_PYTHON" "$here/gloo_check.py" store "$LAB_HEAD_ADDR" $port 40 > "$LAB_DIR/log/store.out" 2>&1 &
    local sp=$! p1 p2
    sleep 1.5
    in_node n1 env $2 "$LAB_PYTHON" "$here/gloo_check.py" rank "$LAB_HEAD_ADDR" $port 0 2 > "$LAB_DIR/log/g1.out" 2>&1 & p1=$!
    in_node n2 env $2 "$LAB_PYTHON" "$here/gloo_check.py" rank "$LAB_HEAD_ADDR" $port 1 2 > "$LAB_DIR/log/g2.out" 2>&1 & p2=$!
    local r1=0 r2=0; wait $p1 || r1=$?; wait $p2 || r2=$?
    kill $sp 2>/dev/null; wait $sp 2>/dev/null
    echo "-- $1: exit $r1/$r2"; tail -n 3 "$LAB_DIR/log/g1.out" "$LAB_DIR/log/g2.out" | grep -v '^$' | sed 's/^/  /'
    [[ $r1 == 0 && $r2 == 0 ]]
  }
  echo "== gloo: 2 ranks in n1 + n2, TCPStore server in the root ns on $LAB_HEAD_ADDR"
  gloo_case "GLOO_SOCKET_IFNAME=$LAB_NODE_IFNAME" "GLOO_SOCKET_IFNAME=$LAB_NODE_IFNAME" || rc=1
  gloo_case "GLOO_SOCKET_IFNAME unset (hostname n1/n2 resolves via /etc/hosts)" "LAB_X=1" || true

  echo "== gloo: 3 ranks via srun: rank 0 in the root ns (GLOO_SOCKET_IFNAME=$LAB_HEAD_IFNAME, also the store), ranks 1-2 on n1/n2"
  port=$((30000 + RANDOM % 1000))
  "$LAB_PYTHON" "$here/gloo_check.py" store "$LAB_HEAD_ADDR" $port 40 > "$LAB_DIR/log/store.out" 2>&1 &
  local sp=$!; sleep 1.5
  GLOO_SOCKET_IFNAME=$LAB_HEAD_IFNAME "$LAB_PYTHON" "$here/gloo_check.py" rank "$LAB_HEAD_ADDR" $port 0 3 > "$LAB_DIR/log/g0.out" 2>&1 &
  local p0=$!
  srun -N2 -n2 --ntasks-per-node=1 --export=ALL,GLOO_SOCKET_IFNAME=$LAB_NODE_IFNAME bash -c \
    "exec $LAB_PYTHON $here/gloo_check.py rank $LAB_HEAD_ADDR $port \$((SLURM_PROCID + 1)) 3" | sed 's/^/  /' || rc=1
  wait $p0 || rc=1; sed 's/^/  /' "$LAB_DIR/log/g0.out"
  kill $sp 2>/dev/null; wait $sp 2>/dev/null
  return $rc
}

cmd_cut() {  # simulate losing a node: its link to the bridge goes down
  [[ ${1:-} == n[12] ]] || die "usage: lab.sh cut n1|n2"
  ip link set "dklabh$(node_idx "$1")" down && echo "$1 cut off"
}
cmd_heal() {
  [[ ${1:-} == n[12] ]] || die "usage: lab.sh heal n1|n2"
  . "$LAB_DIR/env.sh" || die "lab not up"
  ip link set "dklabh$(node_idx "$1")" up
  # slurmctld re-pings a DOWN node only slowly; resume makes it re-contact slurmd now,
  # which also reports and kills the orphaned steps still running on the node
  scontrol update nodename="$1" state=resume 2>/dev/null
  local i; for i in $(seq 40); do [[ $(sinfo -h -n "$1" -o %t) == idle ]] && break; sleep 0.25; done
  echo "$1 back: $(sinfo -h -n "$1" -o %t)"
}

cmd_ps() {  # every process in each node namespace (pid, state, command line); --ours: dist_kernel's only
  local ours=${1:-} n p cmd st
  for n in "${NODES[@]}"; do
    echo "== $n"
    for p in $(ip netns pids "$n" 2>/dev/null); do
      cmd=$(tr '\0' ' ' < "/proc/$p/cmdline" 2>/dev/null) || continue
      st=$(awk '{print $3}' "/proc/$p/stat" 2>/dev/null)
      [[ $ours == --ours && $cmd != *dist_kernel* ]] && continue
      printf '%7s %s %s\n' "$p" "${st:-?}" "${cmd:-[$(cat "/proc/$p/comm" 2>/dev/null)]}"
    done
  done
}

# One lab per machine: two copies of the suite on one machine (issue 20) take turns with it.
# `up` and `down` wait for the lab's lock, unless the caller holds it already (LAB_LOCK_HELD=1:
# a pytest session running its cluster lane, see tests/cluster/cluster_lab.py). flock -o: the
# daemons `up` starts must not inherit the lock
if [[ ${1:-} == up || ${1:-} == down ]] && [[ ${LAB_LOCK_HELD:-} != 1 && $(id -u) == 0 ]] \
    && command -v flock >/dev/null; then
  exec flock -o "$LAB_DIR.lock" env LAB_LOCK_HELD=1 bash "$0" "$@"
fi

case "${1:-}" in
  up) cmd_up ;;
  down) cmd_down ;;
  status) cmd_status ;;
  run-srun-check) cmd_srun_check ;;
  run-ssh-check) cmd_ssh_check ;;
  run-net-check) cmd_net_check ;;
  cut) cmd_cut "${2:-}" ;;
  heal) cmd_heal "${2:-}" ;;
  ps) cmd_ps "${2:-}" ;;
  *) echo "usage: $0 up|down|status|run-srun-check|run-ssh-check|run-net-check|cut NODE|heal NODE|ps [--ours]" >&2; exit 2 ;;
esac
