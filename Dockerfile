# The conductor service. Mount a conductor_config.json at /etc/mooncake/ or register
# streams at run time with POST /register.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY conductor ./conductor
RUN pip install --no-cache-dir .
ENV CONDUCTOR_CONFIG_PATH=/etc/mooncake/conductor_config.json \
    CONDUCTOR_LOG_LEVEL=INFO
EXPOSE 13333
USER nobody
ENTRYPOINT ["mooncake-conductor", "--host", "0.0.0.0"]
