"""The broker's Redis storage: L{relayd.buzz.redis.state.RedisReceipts}, receipts shared by instances."""
