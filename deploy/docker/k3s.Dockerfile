# The k3s server's image: rancher/k3s with regrade added as the entrypoint's first
# step (compose.yaml: `/bin/regrade entrypoint -- k3s server ...`).
#
# rancher/k3s has no C library, so regrade must be the static build (README.md,
# "Images"). Build context: a directory holding that `regrade` binary.
#
#   docker build -f k3s.Dockerfile -t local/k3s-regrade:v1.33.5-k3s1 CONTEXT
#
# K3S_IMAGE picks the k3s release (regrade's tests put their k3s stand-in here).
ARG K3S_IMAGE=rancher/k3s:v1.33.5-k3s1
FROM ${K3S_IMAGE}
COPY regrade /bin/regrade
