# One image with every command of the project: mooncake-conductor (the default),
# mooncake-router, mooncake-register, mooncake-engine-sim, mooncake-demo, mooncake-fleet,
# mooncake-tiny-model.
#   docker build -t conductor .
#   docker run -p 13333:13333 -e CONDUCTOR_REGISTER_ALLOW=10.0.0.0/8 conductor
# The conductor starts with an empty conductor_config.json (engines register themselves:
# mooncake-register); mount one at /etc/mooncake to list streams statically. Kubernetes,
# compose and the addresses containers reach each other at: deploy/ and docs/deploy.md.
# Dependencies are installed at the exact versions of constraints.txt. The project's wheel is
# built in a first stage that has a C compiler (conductor/native/); the image has none.
FROM python:3.11 AS build
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY conductor ./conductor
COPY router ./router
COPY publishers ./publishers
COPY fleet ./fleet
COPY tokenization ./tokenization
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM python:3.11-slim
RUN useradd --system --uid 10001 --home-dir /var/lib/conductor --create-home conductor
WORKDIR /app
COPY constraints.txt ./
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir -c constraints.txt /wheels/*.whl && rm -rf /wheels /root/.cache \
    && mkdir -p /etc/mooncake && echo '{}' > /etc/mooncake/conductor_config.json
ENV CONDUCTOR_CONFIG_PATH=/etc/mooncake/conductor_config.json \
    CONDUCTOR_STATE_FILE=/var/lib/conductor/state.json \
    CONDUCTOR_LOG_LEVEL=INFO \
    HEALTHCHECK_URL=http://127.0.0.1:13333/health
VOLUME /var/lib/conductor
EXPOSE 13333
USER conductor
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen(os.environ['HEALTHCHECK_URL'], timeout=2)"]
ENTRYPOINT ["mooncake-conductor", "--host", "0.0.0.0"]
