"""Tests against each store in this process: the memory twin, the embedded server and, with
TASKRUNNER_TEST_MONGO_URI, a real MongoDB; and the embedded server held to MongoDB's behaviour."""
