# The regrade service's image: the static regrade alone, no base image and no C
# library (README.md, "Images"). Build context: a directory holding that `regrade`
# binary and nsswitch.conf from here.
#
#   docker build -f regrade.Dockerfile -t local/regrade:docker CONTEXT
FROM scratch
COPY regrade /bin/regrade
# A static regrade resolves host names itself: /etc/hosts (Docker writes it), then
# DNS. Without this file glibc asks DNS first and reads /etc/hosts only when DNS is
# unavailable.
COPY nsswitch.conf /etc/nsswitch.conf
ENTRYPOINT ["/bin/regrade"]
