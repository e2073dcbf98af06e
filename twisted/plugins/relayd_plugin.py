from twisted.application.service import ServiceMaker

relayd = ServiceMaker("relayd", "relayd.tap", "Relay for AI agents: AEP, MCP tunnel, Buzz broker", "relayd")
