# One small Slurm cluster in one container: slurmctld, a slurmd per fake node, munge and an sshd
# login node, from Debian bookworm's packages (Slurm 22.05), run by slurm-cluster
# (slurm/entrypoint.sh). The same image also creates the Airflow side's SSH key (`keygen`).
# Build context: docker/ (see docker-compose.yml).
FROM debian:bookworm-slim

ARG LOGIN_USER=skyuser
ARG LOGIN_UID=1000

# slurm-client: sbatch/squeue/sinfo/scontrol/scancel/sacct/srun, used over SSH by the provider;
# openssh-sftp-server: job files are uploaded over SFTP; procps: ps for the supervisor;
# python3: for users' own task YAMLs (`run: python train.py`). util-linux (flock, setpriv),
# coreutils (base64), libc-bin (getent) and mawk are in every Debian image already.
# No baked-in secrets: host keys and the munge key are made per container at start.
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        slurmctld slurmd slurm-client munge \
        openssh-server openssh-sftp-server openssh-client \
        procps python3 ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && rm -f /etc/ssh/ssh_host_* /etc/munge/munge.key

# The login user jobs run as (never root). '*' rather than a locked '!' password, so that sshd
# without PAM accepts key logins.
RUN useradd --create-home --shell /bin/bash --uid "${LOGIN_UID}" --user-group \
        --password '*' "${LOGIN_USER}"

ENV LOGIN_USER=${LOGIN_USER}

COPY slurm/sshd_config /etc/ssh/sshd_config
COPY slurm/slurm.conf.template /usr/local/share/slurm-cluster/slurm.conf.template
COPY slurm/entrypoint.sh /usr/local/bin/slurm-cluster
RUN chmod 0755 /usr/local/bin/slurm-cluster

EXPOSE 22
STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/local/bin/slurm-cluster"]
CMD ["run"]
