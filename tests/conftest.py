pytest_plugins = ["tests.conftest_s3"]
