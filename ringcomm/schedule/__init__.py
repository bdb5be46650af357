"""Pure schedules: functions of sizes and ranks that return data, no sockets."""
