#!/usr/bin/env bash
# System packages of the cluster tier (tests/cluster): a Docker engine to build the image, and what a
# real Kubernetes node runs on (containerd + runc, CNI plugins, iptables, conntrack, dnsmasq for the
# cluster DNS); and Prometheus, whose binary tests/test_dashboards_prometheus.py starts with its own config,
# storage and port to evaluate the Grafana dashboards (the package's own service is stopped: nothing uses it).
# Debian's packages; installed only as root where apt-get exists and one is missing.
# Elsewhere it says what to install and the tier skips with the reason.
set -euo pipefail
PKGS=(docker.io containerd runc containernetworking-plugins iptables conntrack dnsmasq-base xz-utils prometheus)
log() { printf '\033[1m[setup-cluster]\033[0m %s\n' "$*" >&2; }
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then exit 0; fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  log "the cluster tier needs: ${missing[*]} (Debian packages; as root: apt-get install ${missing[*]}); it skips without them"
  exit 0
fi
log "installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
# Where systemd runs, the package starts its own Prometheus on :9090 scraping itself: not ours, stopped.
if [[ " ${missing[*]} " == *" prometheus "* ]] && [ -d /run/systemd/system ]; then
  systemctl disable --now prometheus >/dev/null 2>&1 || true
fi
