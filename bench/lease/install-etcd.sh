#!/bin/sh
# Installs etcd (Debian's etcd-server, 3.4.x) for the lease benchmark
# unless /usr/bin/etcd is already there. Safe to run again.
set -eu
if [ -x /usr/bin/etcd ]; then
	exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
	SUDO=sudo
else
	SUDO=
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update
$SUDO apt-get install -y etcd-server
# The package enables an etcd service on 2379/2380; the benchmark starts its
# own members on free ports and needs none running.
/usr/bin/etcd --version
