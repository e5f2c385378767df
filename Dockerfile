# The image of docker-compose.yml's `init` and `worker`: taskrunner with the versions of
# uv.lock and the example app, installed once when the image is built (a container then
# starts the worker at once; after changing the code, `docker compose up --build`).
FROM python:3.13-slim
ENV UV_COMPILE_BYTECODE=1 UV_LINK_MODE=copy UV_PROJECT_ENVIRONMENT=/opt/venv PATH=/opt/venv/bin:$PATH
RUN pip install --quiet --no-cache-dir --root-user-action=ignore uv
WORKDIR /app
COPY pyproject.toml uv.lock README.md ./
COPY taskrunner ./taskrunner
RUN uv sync --locked --no-dev --no-editable --no-cache
COPY examples ./examples
# Exec form, no shell: the worker is the process `docker stop` signals (docs/operations.md).
CMD ["taskrunner", "worker", "--app", "examples.app:runner"]
