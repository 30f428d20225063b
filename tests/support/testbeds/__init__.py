"""Real test beds started on this machine and stopped by pid (see sshd_host)."""
