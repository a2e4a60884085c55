#!/bin/sh
# One node of a container job over ssh (deploy/compose.yaml): authorizes the job's key from
# $HORA_SSH_KEYS (default /keys, holding id_ed25519 and id_ed25519.pub), starts sshd, then runs
# the given command, or keeps sshd in the foreground when none is given (a worker node).
set -eu
keys=${HORA_SSH_KEYS:-/keys}
mkdir -p /root/.ssh /run/sshd
chmod 700 /root/.ssh
cp "$keys/id_ed25519" /root/.ssh/id_ed25519
cp "$keys/id_ed25519.pub" /root/.ssh/authorized_keys
chmod 600 /root/.ssh/id_ed25519 /root/.ssh/authorized_keys
ssh-keygen -A >/dev/null
if [ "$#" -eq 0 ]; then
    exec /usr/sbin/sshd -D -e
fi
/usr/sbin/sshd -e
exec "$@"
